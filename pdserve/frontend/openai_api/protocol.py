"""OpenAI request bodies, and the ``GenerateRequest`` each choice of one becomes.

Bodies are decoded with msgspec into the Structs below (unknown fields are ignored, as OpenAI's
clients send extras); a value of the wrong type is refused naming its path, and a body that is
not JSON, not UTF-8, or nested past what the decoder recurses into, is refused saying so. Everything else is
checked where gRPC requests are checked (``ModelCatalog``, ``SamplingParams``): this module
only turns fields into ``SamplingOptions`` and prompts into ``GenerateRequest``s. Fields pdserve
cannot honour yet are refused, naming them, rather than ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.frontend.openai_api.errors import ApiError
from pdserve.frontend.openai_api.structured import structured_output
from pdserve.rpc.sampling import set_structured_output
from pdserve.types.sampling_params import MAX_LOGPROBS
from pdserve.v1 import inference_pb2

MAX_CHOICES = 128  # n, and prompts x n in one completion request
_INT32 = 2**31
_INT64 = 2**63


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    """The sampling fields both endpoints take (OpenAI's, then vLLM's extensions)."""

    model: str = ""
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None  # vLLM's: shares prefix-cache blocks only with the same salt
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]]: checked by ``prompts``
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """The body as ``kind``; ApiError 400 naming the bad field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        path = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
        raise ApiError(400, f"invalid request body: {text}", param=path) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:  # msgspec's own, for a string field's bytes
        raise ApiError(400, f"the body is not valid UTF-8: {exc.reason} at byte {exc.start} of a string") from None
    except RecursionError:  # raised by msgspec before it runs out of stack, which it leaves whole
        raise ApiError(400, "the body's JSON is nested too deeply") from None


def check_common(request: _Sampling) -> None:
    """Fields pdserve cannot honour, and counts out of range; ApiError 400 naming the field."""
    if not 1 <= request.n <= MAX_CHOICES:
        raise ApiError(400, f"n must be in [1, {MAX_CHOICES}], got {request.n}", param="n")
    if request.logit_bias:
        raise ApiError(400, "logit_bias is not supported yet", param="logit_bias")
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "stream_options needs stream: true", param="stream_options")
    if request.cache_salt is not None and not request.cache_salt:
        raise ApiError(400, "cache_salt must be a non-empty string when given", param="cache_salt")


def sampling_options(request: _Sampling, max_tokens: int | None) -> inference_pb2.SamplingOptions:
    """The request's ``SamplingOptions``; values are checked later (``SamplingParams``), except
    what the wire cannot carry (an int past its width), refused here naming the field."""
    options = inference_pb2.SamplingOptions(ignore_eos=request.ignore_eos)
    fields = {
        "max_tokens": (max_tokens, _INT32),
        "temperature": (request.temperature, None),
        "top_p": (request.top_p, None),
        "top_k": (request.top_k, _INT32),
        "min_p": (request.min_p, None),
        "seed": (request.seed, _INT64),
        "repetition_penalty": (request.repetition_penalty, None),
        "presence_penalty": (request.presence_penalty, None),
        "frequency_penalty": (request.frequency_penalty, None),
        "min_tokens": (request.min_tokens or None, _INT32),
    }
    for name, (value, bound) in fields.items():
        if value is None:
            continue
        if bound is not None and not -bound <= value < bound:
            raise ApiError(400, f"{name} = {value} is out of range", param=name)
        setattr(options, name, value)
    stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
    options.stop.extend(stop)
    for index, token in enumerate(request.stop_token_ids or []):
        if not 0 <= token < _INT32:
            raise ApiError(400, f"stop_token_ids[{index}] = {token} is not a token id", param="stop_token_ids")
    options.stop_token_ids.extend(request.stop_token_ids or [])
    spec = structured_output(
        request.response_format,
        request.guided_json,
        request.guided_regex,
        request.guided_choice,
        request.guided_grammar,
    )
    if spec is not None:
        set_structured_output(options, spec)
    return options


def top_logprobs(value: int, name: str) -> int:
    """How many top logprobs a token (0: the token's own only), refused past what the wire carries."""
    if not 0 <= value <= MAX_LOGPROBS:
        raise ApiError(400, f"{name} = {value}: must be from 0 to {MAX_LOGPROBS}", param=name)
    return value


def prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completion request: a string, strings, token ids or lists of them."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_token(t) for t in prompt):
            return [_token_ids(prompt, "prompt")]
        if all(isinstance(p, list) for p in prompt):
            return [_token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise ApiError(
        400,
        "prompt must be a string, a list of strings, a list of token ids or a list of "
        "lists of token ids, and not empty",
        param="prompt",
    )


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(values: list[Any], where: str) -> list[int]:
    for index, token in enumerate(values):
        if not _is_token(token) or not 0 <= token < _INT32:
            raise ApiError(400, f"{where}[{index}] = {token!r} is not a token id", param="prompt")
    return values


def generate_request(
    model: str,
    prompt: str | list[int],
    options: inference_pb2.SamplingOptions,
    request_id: str,
    choice: int = 0,
    cache_salt: str | None = None,
) -> inference_pb2.GenerateRequest:
    """The request of one choice. With a seed, choice ``j`` samples with ``seed + j``: the
    ``n`` choices differ, and the same request gives the same choices again."""
    request = inference_pb2.GenerateRequest(
        model=model, sampling=options, request_id=request_id, cache_salt=cache_salt or ""
    )
    if options.HasField("seed") and choice:
        request.sampling.seed = (options.seed + choice + 2**63) % 2**64 - 2**63  # stays an int64
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request
