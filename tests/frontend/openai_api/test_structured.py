"""OpenAI's ``response_format`` and vLLM's ``guided_*`` fields become one structured output,
or a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from pdserve.frontend.openai_api import protocol
from pdserve.frontend.openai_api.errors import ApiError
from pdserve.rpc.sampling import sampling_params
from pdserve.types.structured_output import JSON_OBJECT_SCHEMA, StructuredOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _options(body: dict) -> StructuredOutput | None:
    request = protocol.decode(json.dumps({"messages": [], **body}).encode(), protocol.ChatRequest)
    return sampling_params(protocol.sampling_options(request, 16)).structured


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_schema=JSON_OBJECT_SCHEMA)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutput(json_schema=json.dumps(SCHEMA)),
        ),
        ({"guided_json": SCHEMA}, StructuredOutput(json_schema=json.dumps(SCHEMA))),
        ({"guided_regex": "[0-9]+"}, StructuredOutput(regex="[0-9]+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput(choice=("yes", "no"))),
        ({"guided_grammar": 'start: "a"'}, StructuredOutput(grammar='start: "a"')),
    ],
)
def test_each_form_becomes_its_structured_output(body, expected):
    assert _options(body) == expected


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"response_format": {"type": "xml"}}, "response_format", "response_format.type must be"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format", "schema"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "at most one of"),
    ],
)
def test_a_bad_form_names_its_field(body, param, message):
    with pytest.raises(ApiError) as error:
        _options(body)
    assert error.value.status == 400 and error.value.param == param and message in error.value.message
