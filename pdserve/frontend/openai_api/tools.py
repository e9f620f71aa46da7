"""OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``: checked, the forced choices
enforced with a structured output, and the model's output read back as ``tool_calls``.

- ``"none"``: the template still sees the tools; the output is plain content.
- ``"auto"`` (the default with tools): the model decides; its output is parsed in the format its
  chat template teaches (``text.tool_calls``), and stays content when the format is unknown.
- ``"required"``: the output is constrained to a JSON list of ``{"name", "arguments"}`` (one
  item unless ``parallel_tool_calls``), each call's arguments valid for its function's schema.
- a named function: the output is constrained to that function's arguments.

So a forced call's arguments always parse against the function's JSON schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.frontend.openai_api.errors import ApiError
from pdserve.text.tool_calls import ParsedOutput, ToolCall, ToolCallFormat, parse_tool_calls, tool_call_format
from pdserve.types.structured_output import StructuredOutput

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request's output relates to its tools."""

    mode: Literal["none", "auto", "required", "named"]
    structured: StructuredOutput | None  # what enforces a forced call
    name: str | None = None  # the named function
    fmt: ToolCallFormat | None = None  # "auto": the template's format

    @property
    def reads_calls(self) -> bool:
        """Whether the output can hold calls (else it is plain content, streamed as it comes)."""
        return self.mode in ("named", "required") or (self.mode == "auto" and self.fmt is not None)

    def parse(self, text: str) -> ParsedOutput | None:
        """The output's content and calls; None: plain content (no calls to look for)."""
        if self.mode == "named":
            assert self.name is not None
            return ParsedOutput(content=None, tool_calls=[ToolCall(self.name, text)])
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:  # cut short (max_tokens): the client sees what came
                return None
            return ParsedOutput(
                content=None, tool_calls=[ToolCall(i["name"], json.dumps(i["arguments"])) for i in items]
            )
        if self.mode == "auto" and self.fmt is not None:
            return parse_tool_calls(text, self.fmt)
        return None


def tool_plan(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    chat_template: str | None,
) -> ToolPlan | None:
    """The request's plan, None without tools; ApiError 400 naming the field."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    schemas = {}
    for index, tool in enumerate(tools):
        name, parameters = _function(index, tool)
        schemas[name] = parameters
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", None)
    if choice == "auto":
        return ToolPlan("auto", None, fmt=tool_call_format(chat_template))
    if choice == "required":
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, parameters in schemas.items()
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": call}, "minItems": 1}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", StructuredOutput(json_schema=json.dumps(schema)))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in schemas:
            raise ApiError(400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
        return ToolPlan("named", StructuredOutput(json_schema=json.dumps(schemas[name])), name=name)
    raise ApiError(
        400,
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
    )


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates expect it: an assistant's tool-call arguments as objects
    (OpenAI sends them as JSON text), as transformers and vLLM pass them."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    rendered = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function = {**function, "arguments": json.loads(function["arguments"])}
            except ValueError:
                pass  # the template gets the text as it came
            call = {**call, "function": function}
        rendered.append(call)
    return {**message, "tool_calls": rendered}


def _function(index: int, tool: Any) -> tuple[str, dict[str, Any]]:
    where = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict):
        raise ApiError(400, f"{where}: must be {{'type': 'function', 'function': {{...}}}}", param=where)
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError(400, f"{where}.function.name must match [a-zA-Z0-9_-]{{1,64}}, got {name!r}", param=where)
    parameters = function.get("parameters", _NO_PARAMETERS)
    if not isinstance(parameters, dict):
        raise ApiError(400, f"{where}.function.parameters must be a JSON schema object", param=where)
    return name, parameters
