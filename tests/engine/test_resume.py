"""A request resumed with the tokens it generated elsewhere (a migrated request) goes on with
exactly the tokens it would have generated there: greedy or seeded, with penalties, through
a producer and a consumer too, and its limits count the tokens it resumed with."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import KVRole
from tests.utils.checkpoints import VOCAB

SEEDED = SamplingParams(max_tokens=14, temperature=1.0, top_p=0.9, seed=77, frequency_penalty=0.5, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=14, temperature=0, repetition_penalty=1.3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    path, _ = checkpoints("llama")
    return LLM(str(path), max_model_len=128)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: LLMEngine) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step().outputs:
            tokens = output.token_ids
    engine.check_idle_integrity()
    return tokens


@pytest.mark.parametrize("params", [SEEDED, GREEDY], ids=["seeded", "greedy"])
@pytest.mark.parametrize("num_generated", [1, 5, 13])
def test_a_resumed_request_goes_on_with_the_tokens_it_would_have_generated(llm, params, num_generated):
    prompt = _prompt(1, 21)
    expected = llm.generate([prompt], params)[0].token_ids
    assert len(expected) == params.max_tokens
    engine = llm.engine
    engine.add_request("resumed", prompt, params, generated_token_ids=expected[:num_generated])
    assert _run(engine) == expected  # the whole output: the resumed tokens, then the new ones


def test_a_seeded_request_resumed_without_skipping_its_draws_would_differ(llm):
    """The check above can fail: continuing the seed's stream from its start gives other tokens."""
    prompt = _prompt(1, 21)
    expected = llm.generate([prompt], SEEDED)[0].token_ids
    fresh = SamplingParams(
        max_tokens=SEEDED.max_tokens - 5, temperature=1.0, top_p=0.9, seed=77, frequency_penalty=0.5, ignore_eos=True
    )
    assert llm.generate([prompt + expected[:5]], fresh)[0].token_ids != expected[5:]


def test_a_resumed_request_through_a_producer_and_a_consumer_goes_on_exactly(checkpoints):
    """A migrated request whose KV a prefill worker rebuilds: the producer samples the next
    token with the resumed ones counted, the consumer pulls prompt and resumed tokens' KV."""
    path, _ = checkpoints("llama")
    prompt = _prompt(2, 30)
    expected = LLM(str(path)).generate([prompt], SEEDED)[0].token_ids
    generated = expected[:6]
    producer, consumer = LLM(str(path)).engine, LLM(str(path)).engine
    producer.add_request("r", prompt, SEEDED, kv_role=KVRole.PRODUCER, pin_s=30.0, generated_token_ids=generated)
    first = None
    while first is None:
        first = next((o for o in producer.step().outputs if o.finished), None)
    assert first.finish_reason == "kv_transfer" and first.token_ids == expected[:7]

    consumer.add_request("r", prompt, SEEDED, kv_role=KVRole.CONSUMER, generated_token_ids=generated)
    step = consumer.step()
    _, local_blocks, _ = step.awaiting_kv[0]
    assert len(local_blocks) == len(first.held_block_ids)
    consumer.kv_cache.data[local_blocks] = producer.kv_cache.data[first.held_block_ids]
    producer.kv_sent("r")
    producer.check_idle_integrity()
    assert producer.block_pool.all_free()
    consumer.kv_received("r", first.token_ids[-1])
    assert _run(consumer) == expected
    assert consumer.block_pool.all_free()


def test_max_tokens_counts_the_resumed_tokens(llm):
    prompt = _prompt(3, 12)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = llm.generate([prompt], params)[0].token_ids
    llm.engine.add_request("r", prompt, params, generated_token_ids=expected[:5])
    outputs = []
    while llm.engine.has_unfinished():
        outputs += llm.engine.step().outputs
    assert [o.new_token_ids for o in outputs] == [expected[5:]]
    assert outputs[-1].finish_reason == "length"


@pytest.mark.parametrize(
    ("generated", "message"),
    [
        ([VOCAB], r"generated_token_ids\[0\] = .* outside the vocabulary"),
        ([5] * 6, r"generated_token_ids has 6 tokens: max_tokens \(6\) leaves none"),
        ([5] * 5 + [-1], r"generated_token_ids\[5\] = -1"),
    ],
)
def test_bad_generated_tokens_are_refused_naming_the_field(llm, generated, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", _prompt(4, 8), SamplingParams(max_tokens=6), generated_token_ids=generated)
    assert not llm.engine.has_unfinished()
    llm.engine.check_idle_integrity()


def test_a_resumed_request_that_fills_the_context_window_is_refused(llm):
    with pytest.raises(ValueError, match=r"fill the context window \(max_model_len 128\)"):
        llm.engine.add_request("long", _prompt(5, 100), SamplingParams(max_tokens=64), generated_token_ids=[5] * 28)
