"""A request's structured output, from OpenAI's ``response_format`` or vLLM's ``guided_*`` extras.

- ``response_format``: ``{"type": "text"}`` (free text), ``{"type": "json_object"}`` (any JSON
  object) or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``. The
  schema is enforced whatever ``strict`` says (as vLLM does); a keyword pdserve cannot enforce
  is refused, never ignored.
- vLLM's extras, on both endpoints: ``guided_json`` (a schema, object or JSON text),
  ``guided_regex``, ``guided_choice`` (a list of strings) and ``guided_grammar`` (Lark, GBNF or
  EBNF).

At most one of them. Only the shape is checked here; whether the schema, regex or grammar
compiles is checked with the rest of the request (``ModelCatalog``), naming the problem.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.frontend.openai_api.errors import ApiError
from pdserve.types.structured_output import JSON_OBJECT_SCHEMA, StructuredOutput


def structured_output(
    response_format: dict[str, Any] | None,
    guided_json: dict[str, Any] | str | None,
    guided_regex: str | None,
    guided_choice: list[str] | None,
    guided_grammar: str | None,
) -> StructuredOutput | None:
    """The one structured output the fields ask for, None for free text; ApiError 400 naming the field."""
    given: dict[str, StructuredOutput] = {}
    spec = _response_format(response_format)
    if spec is not None:
        given["response_format"] = spec
    if guided_json is not None:
        text = guided_json if isinstance(guided_json, str) else json.dumps(guided_json)
        given["guided_json"] = _build("guided_json", json_schema=text)
    if guided_regex is not None:
        given["guided_regex"] = _build("guided_regex", regex=guided_regex)
    if guided_choice is not None:
        given["guided_choice"] = _build("guided_choice", choice=tuple(guided_choice))
    if guided_grammar is not None:
        given["guided_grammar"] = _build("guided_grammar", grammar=guided_grammar)
    if len(given) > 1:
        raise ApiError(400, f"set at most one of {sorted(given)}", param=sorted(given)[1])
    return next(iter(given.values()), None)


def _response_format(value: dict[str, Any] | None) -> StructuredOutput | None:
    kind = "text" if value is None else value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_schema=JSON_OBJECT_SCHEMA)
    if kind == "json_schema":
        assert value is not None
        json_schema = value.get("json_schema")
        if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), (dict, bool)):
            raise ApiError(
                400,
                "response_format: a json_schema needs json_schema.schema, a JSON schema object",
                param="response_format",
            )
        return _build("response_format", json_schema=json.dumps(json_schema["schema"]))
    raise ApiError(
        400,
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format",
    )


def _build(field: str, **spec: Any) -> StructuredOutput:
    try:
        return StructuredOutput(**spec)
    except (ValueError, TypeError) as exc:
        raise ApiError(400, f"{field}: {exc}", param=field) from None
