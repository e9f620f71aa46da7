"""``/v1/completions`` and ``/v1/chat/completions``: a body in, the gateway's requests, a body out.

Both turn the body into one ``GenerateRequest`` per choice (``protocol``), admit them on the
``Gateway`` (``choices``), and answer with the whole response or a stream of server-sent events
that ends with ``data: [DONE]`` (``output``). A chat's messages become its prompt through the
model's chat template (``pdserve.text.chat_template``); that text holds its special tokens, so
it is tokenized without adding more. A body's ``cache_salt`` (vLLM's field) goes with every
choice, combined with the caller's key's salt when salts come from keys.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pdserve.frontend.attempt import FlowError
from pdserve.frontend.catalog import InvalidRequest, ModelInfo, ModelUnavailable, UnknownModel
from pdserve.frontend.gateway import Admitted, Gateway
from pdserve.frontend.openai_api import protocol
from pdserve.frontend.openai_api.choices import Event, admit_all, collect_unless_disconnected, first_event, merged
from pdserve.frontend.openai_api.errors import ApiError
from pdserve.frontend.openai_api.logprobs import TokenText
from pdserve.frontend.openai_api.output import SSE_DONE, Output, sse
from pdserve.frontend.openai_api.tools import template_message, tool_plan
from pdserve.rpc.sampling import set_structured_output
from pdserve.text.chat_template import ChatTemplateError, load_chat_template, load_special_tokens, render_chat


class ChatTemplates:
    """Each model's chat template and special tokens, read once (off the event loop)."""

    def __init__(self, tokenizer_path: str | None) -> None:
        self.tokenizer_path = tokenizer_path
        self._loaded: dict[str, tuple[str | None, dict[str, str]]] = {}

    async def get(self, model: ModelInfo) -> tuple[str, dict[str, str]]:
        path = str(Path(self.tokenizer_path or model.model_path))
        if path not in self._loaded:
            try:
                self._loaded[path] = await asyncio.to_thread(
                    lambda: (load_chat_template(path), load_special_tokens(path))
                )
            except ValueError as exc:
                raise ApiError(500, f"model {model.name!r}: {exc}") from None
        template, tokens = self._loaded[path]
        if template is None:
            raise ApiError(
                400,
                f"model {model.name!r} has no chat template (chat_template in tokenizer_config.json "
                "or chat_template.jinja); use /v1/completions",
                param="messages",
            )
        return template, tokens


async def completions(gateway: Gateway, request: Request, body: bytes) -> Response:
    req: protocol.CompletionRequest = protocol.decode(body, protocol.CompletionRequest)
    protocol.check_common(req)
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if req.best_of not in (None, req.n):
        raise ApiError(
            400, f"best_of must equal n ({req.n}) when set: pdserve returns every choice it makes", param="best_of"
        )
    prompts = protocol.prompts(req.prompt)
    if len(prompts) * req.n > protocol.MAX_CHOICES:
        raise ApiError(
            400, f"{len(prompts)} prompts x n = {req.n} choices: at most {protocol.MAX_CHOICES} a request", param="n"
        )
    options = protocol.sampling_options(req, req.max_tokens)
    if req.logprobs is not None:
        options.logprobs = protocol.top_logprobs(req.logprobs, "logprobs")
    base = uuid.uuid4().hex
    requests = [
        protocol.generate_request(
            req.model, p, options, f"cmpl-{base}-{i * req.n + j}", choice=j, cache_salt=req.cache_salt
        )
        for i, p in enumerate(prompts)
        for j in range(req.n)
    ]
    admitted = await admit_all(gateway, requests, key_salt=_key_salt(request))
    echo = [_echo_text(admitted[i * req.n], p) for i, p in enumerate(prompts)] if req.echo else None
    output = Output(
        "completion",
        _model_name(admitted),
        len(requests),
        req.n,
        echo=echo,
        include_usage=_include_usage(req),
        token_text=_token_text(admitted, req.logprobs is not None),
    )
    return await _respond(request, req.stream, admitted, output)


async def chat_completions(gateway: Gateway, templates: ChatTemplates, request: Request, body: bytes) -> Response:
    req: protocol.ChatRequest = protocol.decode(body, protocol.ChatRequest)
    protocol.check_common(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if (
        req.max_tokens is not None
        and req.max_completion_tokens is not None
        and req.max_tokens != req.max_completion_tokens
    ):
        raise ApiError(400, "max_tokens and max_completion_tokens differ: set one", param="max_completion_tokens")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    model = _model(gateway, req.model)
    template, special_tokens = await templates.get(model)
    messages = [_message(i, m) for i, m in enumerate(req.messages)]
    if not messages:
        raise ApiError(400, "messages is empty", param="messages")
    variables: dict[str, Any] = dict(req.chat_template_kwargs or {})
    reserved = sorted(set(variables) & {"template", "messages", "add_generation_prompt", "special_tokens"})
    if reserved:
        raise ApiError(
            400, f"chat_template_kwargs: {reserved} are set by the request itself", param="chat_template_kwargs"
        )
    tools = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, template)
    if req.tools is not None:
        variables["tools"] = req.tools
    try:
        prompt = await asyncio.to_thread(
            render_chat,
            template,
            messages,
            add_generation_prompt=req.add_generation_prompt,
            special_tokens=special_tokens,
            **variables,
        )
    except ChatTemplateError as exc:
        raise ApiError(400, f"messages: {exc}", param="messages") from None
    options = protocol.sampling_options(req, max_tokens)
    if tools is not None and tools.structured is not None:
        if options.WhichOneof("structured") is not None:
            raise ApiError(400, f"tool_choice {tools.mode!r} and response_format: set one", param="tool_choice")
        set_structured_output(options, tools.structured)
    if req.logprobs:
        options.logprobs = protocol.top_logprobs(req.top_logprobs or 0, "top_logprobs")
    base = uuid.uuid4().hex
    requests = [
        protocol.generate_request(
            model.name, prompt, options, f"chatcmpl-{base}-{j}", choice=j, cache_salt=req.cache_salt
        )
        for j in range(req.n)
    ]
    admitted = await admit_all(
        gateway,
        requests,
        add_special_tokens=False,
        fill_context=max_tokens is None,
        key_salt=_key_salt(request),
    )
    output = Output(
        "chat",
        model.name,
        req.n,
        req.n,
        include_usage=_include_usage(req),
        token_text=_token_text(admitted, req.logprobs),
        tool_calls=tools.parse if tools is not None and tools.reads_calls else None,
    )
    return await _respond(request, req.stream, admitted, output)


async def _respond(request: Request, stream: bool, admitted: list[Admitted], output: Output) -> Response:
    events = merged(admitted)
    if not stream:
        for index, message in await collect_unless_disconnected(request, events):
            output.add(index, message)
        return Response(msgspec.json.encode(output.response()), media_type="application/json")
    first = await first_event(events)
    return StreamingResponse(
        _sse(first, events, output), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _sse(first: Event, events: AsyncGenerator[Event, None], output: Output) -> AsyncIterator[bytes]:
    """The chunks, then usage (when asked for) and ``[DONE]``. Starlette cancels this when the
    client leaves; closing ``events`` then cancels every choice."""
    async with aclosing(events):
        try:
            chunk = output.chunk(*first)
            if chunk is not None:
                yield sse(chunk)
            async for index, message in events:
                chunk = output.chunk(index, message)
                if chunk is not None:
                    yield sse(chunk)
        except FlowError as exc:  # the status line is sent: the error goes in the stream
            yield sse(ApiError.from_grpc(exc.code, exc.message).body())
            yield SSE_DONE
            return
    if output.include_usage:
        yield sse(output.usage_chunk())
    yield SSE_DONE


def _key_salt(request: Request) -> str | None:
    """The caller's key's prefix-cache salt, which the app's authentication left on the request."""
    return getattr(request.state, "key_salt", None)


def _model(gateway: Gateway, name: str) -> ModelInfo:
    try:
        return gateway.catalog.model(name, gateway.routing.view.workers())
    except UnknownModel as exc:
        raise ApiError(404, str(exc), param="model", code="model_not_found") from None
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param="model") from None
    except ModelUnavailable as exc:
        raise ApiError(503, str(exc)) from None


def _message(index: int, message: dict[str, Any]) -> dict[str, Any]:
    """A chat message for the template: its content as one string (text parts joined)."""
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise ApiError(400, f"messages[{index}].role must be a non-empty string", param=f"messages[{index}].role")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(
                    400,
                    f"messages[{index}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                    param=f"messages[{index}].content",
                )
            texts.append(part["text"])
        content = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise ApiError(
            400,
            f"messages[{index}].content must be a string, a list of text parts or null",
            param=f"messages[{index}].content",
        )
    return template_message({**message, "content": content})


def _echo_text(admitted: Admitted, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    tokenizer = admitted.flow.request.tokenizer
    return tokenizer.decode(prompt, skip_special_tokens=False) if tokenizer is not None else ""


def _token_text(admitted: list[Admitted], wanted: bool) -> TokenText | None:
    """A token's text for the logprobs objects, when the request asked for logprobs."""
    if not wanted:
        return None
    tokenizer = admitted[0].flow.request.tokenizer
    if tokenizer is None:
        return str  # no tokenizer: the id stands for the token
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


def _model_name(admitted: list[Admitted]) -> str:
    return admitted[0].flow.request.model.name


def _include_usage(req: protocol.CompletionRequest | protocol.ChatRequest) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage
