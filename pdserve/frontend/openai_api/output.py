"""OpenAI response bodies for completions and chat completions, built from the gateway's messages.

One ``Output`` a request: ``chunk`` turns a choice's message into a streamed chunk, ``add``
records one for the whole response that ``response`` builds. A choice's last message carries
its finish reason and, under ``pdserve``, its latency breakdown (``LatencyBreakdown`` with the
cached prompt tokens), listed by choice index.

A chat request with tools gives ``tool_calls``: its text is read for calls (``ToolPlan.parse``)
once whole, so a streamed choice holds its text back and sends it, with its calls as
``delta.tool_calls``, in its last chunk; a choice with calls finishes with ``"tool_calls"``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

import msgspec
from google.protobuf.json_format import MessageToDict

from pdserve.frontend.openai_api.logprobs import ChoiceLogprobs, TokenText
from pdserve.text.tool_calls import ParsedOutput
from pdserve.v1 import inference_pb2

Kind = Literal["completion", "chat"]


class Output:
    """Attributes:
    kind: a completion (``text_completion``) or a chat completion.
    model: the served model's name, as responses report it.
    num_choices / n: all choices, and choices per prompt (choice i answers prompt i // n).
    echo: per prompt, the text to put before its completions (completions' ``echo``), or None.
    include_usage: streaming: each chunk has ``usage`` (null), and a last chunk has the totals.
    token_text: a token's text, when the request asked for logprobs; None: ``logprobs`` is null.
    tool_calls: a chat choice's text to its content and tool calls (None: plain content).
    """

    def __init__(
        self,
        kind: Kind,
        model: str,
        num_choices: int,
        n: int,
        *,
        echo: list[str] | None = None,
        include_usage: bool = False,
        token_text: TokenText | None = None,
        tool_calls: Callable[[str], ParsedOutput | None] | None = None,
    ) -> None:
        self.kind = kind
        self.model = model
        self.n = n
        self.echo = echo
        self.include_usage = include_usage
        self.tool_calls = tool_calls
        self.id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.texts = [""] * num_choices
        self.finals: list[inference_pb2.Final | None] = [None] * num_choices
        self._started = [False] * num_choices
        self.logprobs: list[ChoiceLogprobs] | None = None
        if token_text is not None:
            offsets = [len(echo[i // n]) if echo is not None else 0 for i in range(num_choices)]
            self.logprobs = [ChoiceLogprobs(kind, token_text, offset) for offset in offsets]

    # ---- streaming -------------------------------------------------------------------------
    def chunk(self, index: int, message: inference_pb2.GenerateResponse) -> dict[str, Any] | None:
        """The chunk for a choice's message; None when it brings nothing to send."""
        first = not self._started[index]
        self._started[index] = True
        text = message.text
        if first and self.echo is not None:
            text = self.echo[index // self.n] + text
        final = message.final if message.HasField("final") else None
        self.finals[index] = final or self.finals[index]
        if self.logprobs is not None:
            self.logprobs[index].add(message.token_ids, message.logprobs)
        finish_reason = final.finish_reason if final is not None else None
        calls: list[dict[str, Any]] = []
        if self.tool_calls is not None:  # held back until the text is whole
            self.texts[index] += text
            text = ""
            if final is not None:
                content, calls, finish_reason = self._message(final.text, final.finish_reason)
                text = content or ""
        if not text and final is None and not (first and self.kind == "chat"):
            return None
        choice: dict[str, Any] = {"index": index}
        logprobs = self.logprobs[index].body() if self.logprobs is not None else None
        if self.kind == "completion":
            choice |= {"text": text, "logprobs": logprobs}
        else:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            choice |= {"delta": delta, "logprobs": logprobs}
        choice["finish_reason"] = finish_reason
        body = self._envelope(chunk=True, choices=[choice])
        if final is not None:
            body["pdserve"] = {"choices": [self._breakdown(index, final)]}
        return body

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk with ``include_usage``: no choices, the totals."""
        return self._envelope(chunk=True, choices=[]) | {"usage": self.usage()}

    # ---- whole response --------------------------------------------------------------------
    def add(self, index: int, message: inference_pb2.GenerateResponse) -> None:
        if self.logprobs is not None:
            self.logprobs[index].add(message.token_ids, message.logprobs)
        if message.HasField("final"):
            self.finals[index] = message.final

    def response(self) -> dict[str, Any]:
        choices = []
        for index, final in enumerate(self.finals):
            assert final is not None, f"choice {index} ended without a final message"
            text = final.text if self.echo is None else self.echo[index // self.n] + final.text
            logprobs = self.logprobs[index].body(everything=True) if self.logprobs is not None else None
            if self.kind == "completion":
                choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs}
                choices.append(choice | {"finish_reason": final.finish_reason})
                continue
            content, calls, finish_reason = self._message(text, final.finish_reason)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason})
        breakdowns = [self._breakdown(i, f) for i, f in enumerate(self.finals) if f is not None]
        return self._envelope(chunk=False, choices=choices) | {
            "usage": self.usage(),
            "pdserve": {"choices": breakdowns},
        }

    # ---- shared ----------------------------------------------------------------------------
    def _message(self, text: str, finish_reason: str) -> tuple[str | None, list[dict[str, Any]], str]:
        """A chat choice's content, its tool calls in OpenAI's shape, and its finish reason."""
        parsed = self.tool_calls(text) if self.tool_calls is not None else None
        if parsed is None or not parsed.tool_calls:
            return text, [], finish_reason
        calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in parsed.tool_calls
        ]
        return parsed.content, calls, "tool_calls" if finish_reason == "stop" else finish_reason

    def usage(self) -> dict[str, Any]:
        """Totals: each prompt's tokens once, every choice's completion tokens."""
        finals = [f for f in self.finals if f is not None]
        firsts = [f for i, f in enumerate(self.finals) if f is not None and i % self.n == 0]
        prompt = sum(f.usage.prompt_tokens for f in firsts)
        completion = sum(f.usage.completion_tokens for f in finals)
        cached = sum(f.usage.cached_prompt_tokens for f in firsts)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _envelope(self, *, chunk: bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "text_completion" if self.kind == "completion" else "chat.completion" + (".chunk" if chunk else "")
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if chunk and self.include_usage:
            body["usage"] = None
        return body

    @staticmethod
    def _breakdown(index: int, final: inference_pb2.Final) -> dict[str, Any]:
        breakdown = MessageToDict(
            final.breakdown, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        breakdown["kv_transfer_bytes"] = int(breakdown.get("kv_transfer_bytes", 0))  # int64 comes as a string
        return {"index": index, **breakdown, "cached_prompt_tokens": final.usage.cached_prompt_tokens}


def sse(body: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
