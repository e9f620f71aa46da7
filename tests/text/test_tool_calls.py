"""Tool calls read back from a model's output in its family's format; what does not parse stays text."""

from __future__ import annotations

import json

import pytest

from pdserve.text.tool_calls import ParsedOutput, ToolCall, parse_tool_calls, tool_call_format

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris"}))
TIME = ToolCall("get_time", json.dumps({"zone": "UTC"}))


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("{% for t in tools %}<tools>{{ t }}</tools>{% endfor %}<tool_call>", "hermes"),
        ("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
        ("<|start_header_id|>ipython<|end_header_id|>{{ '<|python_tag|>' }}", "llama3"),
        ("{{ messages }}", None),
        (None, None),
    ],
)
def test_the_format_is_read_from_the_template(template, fmt):
    assert tool_call_format(template) == fmt


@pytest.mark.parametrize(
    ("fmt", "text", "expected"),
    [
        (
            "hermes",
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
            ParsedOutput("Let me look.", [WEATHER, TIME]),
        ),
        ("hermes", "<tool_call>{not json}</tool_call>", ParsedOutput("<tool_call>{not json}</tool_call>", [])),
        ("hermes", "just text", ParsedOutput("just text", [])),
        (
            "mistral",
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]',
            ParsedOutput(None, [WEATHER, TIME]),
        ),
        ("mistral", "[TOOL_CALLS] [{", ParsedOutput("[TOOL_CALLS] [{", [])),
        (
            "llama3",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "UTC"}}',
            ParsedOutput(None, [WEATHER, TIME]),
        ),
        ("llama3", "The weather is fine.", ParsedOutput("The weather is fine.", [])),
    ],
)
def test_calls_are_parsed_in_each_format(fmt, text, expected):
    assert parse_tool_calls(text, fmt) == expected
