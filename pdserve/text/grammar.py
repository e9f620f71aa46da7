"""Structured outputs on llguidance: a ``StructuredOutput`` checked, compiled once, and matched
token by token.

- ``check_structured`` says what is wrong with a schema, regex, choice list or grammar (a
  ValueError naming it), without a tokenizer: the frontend calls it, on a thread, before any
  worker is used.
- ``GrammarCompiler`` turns one into an ``LLMatcher`` for a model's tokenizer. Compiling (the
  lexer, the JSON schema's grammar) is the costly part, done once per distinct spec and kept in
  a bounded LRU; each request gets a cheap ``deep_copy`` of the compiled matcher. Safe to call
  from several threads (llguidance drops the GIL while it compiles).

A matcher is the request's grammar state: it advances with each token the request takes,
wherever the token was sampled, so a request resumed elsewhere (the decode worker after a
hand-off, a migration) rebuilds it by replaying its tokens (``engine.request``). Why llguidance: it
takes JSON schema, regex, choices and Lark / GBNF grammars in one engine, imports nothing
(neither torch nor numpy: this module loads in the frontend), and computes each mask as it
goes, with no pass over the vocabulary per schema; xgrammar needs torch, transformers and
triton, and outlines-core has no context-free grammars.

Imports llguidance, and no torch (the mask is applied in ``engine.grammar_mask``).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance

from pdserve.text.tokenizer import Tokenizer
from pdserve.types.structured_output import StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON as ``json.dumps`` writes it by default. Free whitespace (llguidance's default) lets a
# model spend all its tokens on blanks between two values, a known failure of any-whitespace
# JSON grammars; a schema may still ask otherwise with its own "x-guidance" options.
JSON_LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Distinct specs kept compiled per engine; a JSON schema's matcher is tens of kB to a few MB.
GRAMMAR_CACHE_SIZE = 128


def grammar_source(spec: StructuredOutput) -> str:
    """The llguidance grammar of ``spec`` (not yet checked); raises ValueError naming the field."""
    try:
        if spec.json_schema is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.json_schema, defaults=JSON_LAYOUT)
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        assert spec.grammar is not None
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as exc:
        raise ValueError(f"{spec.kind}: {exc}") from None


def check_structured(spec: StructuredOutput) -> None:
    """Raise ValueError naming the field and the problem when ``spec`` cannot be compiled
    (an unknown JSON schema keyword or type, a regex or grammar that does not parse)."""
    error = _grammar_error(spec)
    if error:
        raise ValueError(f"{spec.kind}: {error}")


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _grammar_error(spec: StructuredOutput) -> str:
    """Empty when ``spec`` compiles; each distinct spec is checked once (bounded)."""
    try:
        return llguidance.LLMatcher.validate_grammar(grammar_source(spec), None).strip()
    except ValueError as exc:
        return str(exc).removeprefix(f"{spec.kind}: ")


class GrammarCompiler:
    """Matchers for one model's tokenizer, each distinct spec compiled once (LRU of ``cache_size``)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        cache_size: int = GRAMMAR_CACHE_SIZE,
    ) -> None:
        """``vocab_size``: the width of the model's logits (a mask covers it all; ids past the
        tokenizer's are never allowed); ``eos_token_ids`` end a finished grammar."""
        self._tokenizer = _lltokenizer(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations so far (the cache's misses)

    def compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """The compiled matcher of ``spec``, at its start: shared, so copy it before use
        (``matcher``). Raises ValueError naming the problem."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
        compiled = llguidance.LLMatcher(self._tokenizer, grammar_source(spec), log_level=0)
        if compiled.is_error():
            raise ValueError(f"{spec.kind}: {compiled.get_error().strip()}")
        with self._lock:
            self.num_compiled += 1
            self._compiled[spec] = compiled
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher of ``spec`` for one request. Raises ValueError naming the problem."""
        return self.compile(spec).deep_copy()


def _lltokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    eos = eos_token_ids or None  # None: the tokenizer's own
    return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos)
