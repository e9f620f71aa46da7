"""Tool calls in a model's output, in the format its chat template taught it.

Each model family writes calls its own way; ``tool_call_format`` recognises the family from the
chat template's text (the markers it renders), and ``parse_tool_calls`` cuts the output into the
text around the calls and the calls themselves:

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  once per call;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``;
- ``llama3`` (Llama 3.1+ JSON tool calling): ``<|python_tag|>`` (optional) then
  ``{"name": ..., "parameters": {...}}``, several separated by ``;``.

A call that does not parse as JSON with a name is left in the text: the client sees what the
model wrote. Standard library only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

ToolCallFormat = Literal["hermes", "mistral", "llama3"]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_MISTRAL = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's ``function.arguments``


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # the text around the calls; None when there is none
    tool_calls: list[ToolCall]


def tool_call_format(chat_template: str | None) -> ToolCallFormat | None:
    """The tool-call format a chat template teaches, None when it shows none pdserve knows."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if _MISTRAL in chat_template:
        return "mistral"
    if _PYTHON_TAG in chat_template or ("ipython" in chat_template and '"parameters"' in chat_template):
        return "llama3"
    return None


def parse_tool_calls(text: str, fmt: ToolCallFormat) -> ParsedOutput:
    """The calls in ``text`` and the text around them."""
    if fmt == "hermes":
        calls = []
        rest = text
        for found in _HERMES.finditer(text):
            call = _call(found.group(1), "arguments")
            if call is not None:
                calls.append(call)
                rest = rest.replace(found.group(0), "", 1)
        return _parsed(rest, calls)
    if fmt == "mistral":
        head, marker, tail = text.partition(_MISTRAL)
        if not marker:
            return _parsed(text, [])
        try:
            items = json.loads(tail)
        except ValueError:
            return _parsed(text, [])
        items = items if isinstance(items, list) else [items]
        calls = [c for c in (_call(json.dumps(item), "arguments") for item in items) if c is not None]
        return _parsed(head, calls) if len(calls) == len(items) else _parsed(text, [])
    body = text.strip().removeprefix(_PYTHON_TAG)
    parts = [p for p in body.split(";") if p.strip()]
    calls = [c for c in (_call(p, "parameters") for p in parts) if c is not None]
    return _parsed("", calls) if calls and len(calls) == len(parts) else _parsed(text, [])


def _call(text: str, arguments_key: str) -> ToolCall | None:
    try:
        item = json.loads(text)
    except ValueError:
        return None
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get(arguments_key, item.get("arguments", {}))
    return ToolCall(item["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def _parsed(rest: str, calls: list[ToolCall]) -> ParsedOutput:
    rest = rest.strip() if calls else rest
    return ParsedOutput(content=rest or None, tool_calls=calls)
