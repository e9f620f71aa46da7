"""Structured outputs offline: a tiny random model's output matches its JSON schema, regex,
choice or grammar under greedy and seeded sampling; a finished grammar ends the request; a
bad spec is refused naming the problem; a request resumed mid-output (as after a hand-off or a
migration) goes on exactly as if it had run here."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.request import KVRole
from pdserve.types.structured_output import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "nested": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "nested"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [0-9]{2,4}"
GRAMMAR = 'start: expr\nexpr: NUMBER | "(" expr OP expr ")"\nOP: "+" | "*"\nNUMBER: /[1-9]/'
PROMPTS = ["hello world", "the quick brown fox", "Numbers: 0 1 2 3"]


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    path, _ = checkpoints("llama")
    return LLM(str(path), max_model_len=256)


def _params(structured: StructuredOutput, **kwargs: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 120, "temperature": 0, "structured": structured, **kwargs})


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 7}])
def test_json_schema_output_validates(llm, sampling):
    params = _params(StructuredOutput(json_schema=json.dumps(SCHEMA)), **sampling)
    for output in llm.generate(PROMPTS, params):
        assert output.finish_reason == "stop", output
        jsonschema.validate(json.loads(output.text), SCHEMA)


def test_regex_choice_and_grammar_outputs_match(llm):
    specs = [
        StructuredOutput(regex=REGEX),
        StructuredOutput(choice=("red", "green", "blue")),
        StructuredOutput(grammar=GRAMMAR),
    ]
    outputs = llm.generate([PROMPTS[0]] * 3, [_params(spec) for spec in specs])
    assert all(o.finish_reason == "stop" for o in outputs), outputs
    assert re.fullmatch(REGEX, outputs[0].text), outputs[0].text
    assert outputs[1].text in ("red", "green", "blue")
    assert re.fullmatch(r"[1-9()+*]+", outputs[2].text) and outputs[2].text.count("(") == outputs[2].text.count(")")
    # The constraint is what shaped them: unconstrained, the random model says something else.
    free = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0))[0].text
    assert not re.fullmatch(REGEX, free) and free not in ("red", "green", "blue")


def test_constrained_and_free_rows_share_a_batch(llm):
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))
    alone = llm.generate([PROMPTS[1]], _params(spec))[0]
    free_alone = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    batched = llm.generate(
        [PROMPTS[2], PROMPTS[1]], [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), _params(spec)]
    )
    assert batched[1].token_ids == alone.token_ids
    assert batched[0].token_ids == free_alone.token_ids


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (StructuredOutput(json_schema='{"type": "bogus"}'), "json_schema: Invalid type: bogus"),
        (StructuredOutput(regex="[a-"), "regex: "),
        (StructuredOutput(grammar="start: undefined_rule"), 'unknown name: "undefined_rule"'),
    ],
)
def test_a_bad_spec_is_refused_naming_it(llm, spec, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        llm.generate(PROMPTS[0], _params(spec))
    assert not llm.engine.has_unfinished()


def test_spec_shape_is_checked():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=("b",))
    with pytest.raises(ValueError, match="json_schema: not valid JSON"):
        StructuredOutput(json_schema="{not json")


def test_a_resumed_request_replays_its_grammar(llm):
    """What a decode worker does after a hand-off, or after a migration: the tokens so far
    come in, and the grammar goes on from them."""
    params = _params(StructuredOutput(json_schema=json.dumps(SCHEMA)))
    whole = llm.generate(PROMPTS[0], params)[0]
    engine = llm.engine
    for cut in (1, len(whole.token_ids) // 2):
        engine.add_request(f"resumed-{cut}", PROMPTS[0], params, generated_token_ids=whole.token_ids[:cut])
        final = None
        while engine.has_unfinished():
            for output in engine.step().outputs:
                final = output
        assert final is not None and final.token_ids == whole.token_ids and final.finish_reason == "stop"
    # Tokens that break the grammar cannot be resumed with.
    with pytest.raises(ValueError, match="break the request's structured output"):
        engine.add_request("bad", PROMPTS[0], params, generated_token_ids=llm.tokenizer.encode("nope", False))


def test_a_producer_first_token_obeys_and_a_consumer_continues(llm):
    params = _params(StructuredOutput(regex=REGEX))
    whole = llm.generate(PROMPTS[1], params)[0]
    engine = llm.engine
    engine.add_request("p", PROMPTS[1], params, KVRole.PRODUCER, pin_s=30)
    produced = None
    while produced is None:
        produced = next((o for o in engine.step().outputs if o.finished), None)
    assert produced.token_ids == whole.token_ids[:1]
    engine.release_pin("p")
    # The consumer computes nothing of the prompt here: it takes the first token as a peer's.
    assert engine.admit_consumer("c", llm.tokenizer.encode(PROMPTS[1]), params) is not None
    assert engine.kv_received("c", produced.token_ids[0]) is None
    engine.abort("c")
    engine.check_idle_integrity()
