"""What a request's output must match: a JSON schema, a regex, one of a list of strings, or a
grammar. Checked for shape here (exactly one kind, each non-empty); whether the schema, regex
or grammar itself is valid is for ``pdserve.text.grammar`` to say. Imports nothing but msgspec
and json, like the rest of ``types``.
"""

from __future__ import annotations

import json

import msgspec

# Any JSON object: OpenAI's ``response_format: {"type": "json_object"}``.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    """Exactly one of:

    Attributes:
        json_schema: a JSON schema, as JSON text; the output is JSON that validates against it.
        regex: the whole output matches this regular expression (Rust ``regex`` syntax).
        choice: the output is exactly one of these strings.
        grammar: the output is a sentence of this Lark grammar (start rule ``start``), or of a
            GBNF / EBNF grammar (start rule ``root``).
    """

    json_schema: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in self.__struct_fields__ if getattr(self, name) is not None]
        if len(kinds) != 1:
            raise ValueError(f"structured output: set exactly one of {list(self.__struct_fields__)}, got {kinds}")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except ValueError as exc:
                raise ValueError(f"json_schema: not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"json_schema: a schema is a JSON object, got {type(schema).__name__}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"choice must be a non-empty list of non-empty strings, got {list(self.choice)!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not value:
                raise ValueError(f"{name} is empty")

    @property
    def kind(self) -> str:
        """The name of the one field set."""
        return next(name for name in self.__struct_fields__ if getattr(self, name) is not None)
