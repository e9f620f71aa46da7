"""``tools`` and ``tool_choice``: forced calls become the structured output that enforces them,
and outputs are read back as calls; bad tools and choices are a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.frontend.openai_api.errors import ApiError
from pdserve.frontend.openai_api.tools import template_message, tool_plan
from pdserve.text.tool_calls import ToolCall

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]


def test_a_named_choice_constrains_the_output_to_its_arguments():
    plan = tool_plan(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, None)
    assert plan is not None and json.loads(plan.structured.json_schema) == WEATHER
    assert plan.parse('{"city": "Rome"}').tool_calls == [ToolCall("get_weather", '{"city": "Rome"}')]


@pytest.mark.parametrize(("parallel", "max_items"), [(None, None), (True, None), (False, 1)])
def test_required_constrains_the_output_to_a_list_of_calls(parallel, max_items):
    plan = tool_plan(TOOLS, "required", parallel, None)
    schema = json.loads(plan.structured.json_schema)
    assert schema.get("maxItems") == max_items and schema["minItems"] == 1
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(calls[: max_items or 2], schema)
    if max_items == 1:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(calls, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}}], schema)
    assert [c.name for c in plan.parse(json.dumps(calls)).tool_calls] == ["get_weather", "get_time"]
    assert plan.parse('[{"name": "get_w') is None  # cut short: the text stays content


def test_auto_parses_in_the_templates_format_and_none_does_not():
    auto = tool_plan(TOOLS, None, None, "... <tool_call> ...")
    assert auto.mode == "auto" and auto.structured is None
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert auto.parse(text).tool_calls == [ToolCall("get_time", "{}")]
    assert auto.reads_calls
    for plan in (tool_plan(TOOLS, "none", None, "<tool_call>"), tool_plan(TOOLS, "auto", None, "no format here")):
        assert plan.parse(text) is None and not plan.reads_calls  # plain content, streamed as it comes
    assert tool_plan(None, None, None, None) is None


@pytest.mark.parametrize(
    ("tools", "choice", "param", "message"),
    [
        (None, "required", "tool_choice", "tool_choice needs tools"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "'nope', which is not in tools"),
        (TOOLS, "sometimes", "tool_choice", "tool_choice must be"),
        ([{"type": "retrieval"}], None, "tools[0]", "tools[0]: must be"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0]", "name must match"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools[0]", "parameters must be"),
    ],
)
def test_bad_tools_and_choices_name_the_field(tools, choice, param, message):
    with pytest.raises(ApiError) as error:
        tool_plan(tools, choice, None, None)
    assert error.value.status == 400 and error.value.param == param and message in error.value.message


def test_an_assistants_call_arguments_reach_the_template_as_an_object():
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }
    assert template_message(message)["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert template_message({"role": "tool", "content": "1", "tool_call_id": "c1"})["tool_call_id"] == "c1"
