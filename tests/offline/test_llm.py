"""The offline API end to end: prompts, sampling options, stops, bad input, abort, and the
prefill/decode seams (a producer's held blocks continued by a consumer)."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.request import KVRole
from tests.utils.checkpoints import VOCAB
from tests.utils.stop_strings import stop_after_the_first_token


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    path, _ = checkpoints("llama")
    return LLM(str(path), max_model_len=128)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_text_prompts_and_one_token_list_prompt(llm):
    outputs = llm.generate(["hello world", "the quick brown fox"], SamplingParams(max_tokens=5, temperature=0))
    assert len(outputs) == 2 and all(1 <= len(o.token_ids) <= 5 for o in outputs)
    single = llm.generate(_prompt(0, 7), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(single) == 1 and len(single[0].token_ids) == 3
    assert single[0].text == llm.tokenizer.decode(single[0].token_ids)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([_prompt(1, 20)], params)[0].token_ids
    batched = llm.generate(
        [_prompt(2, 9), _prompt(1, 20), _prompt(3, 33)],
        [SamplingParams(max_tokens=5, temperature=1.0), params, SamplingParams(max_tokens=20, temperature=0.7)],
    )
    assert batched[1].token_ids == alone
    other_seed = llm.generate(
        [_prompt(1, 20)], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    )
    assert other_seed[0].token_ids != alone


def test_stop_token_ids_and_eos(llm):
    greedy = llm.generate([_prompt(4, 10)], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    stop_at = greedy.token_ids[3]
    stopped = llm.generate([_prompt(4, 10)], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_at]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_at) + 1]


def test_min_tokens_holds_back_stop_token_ids_and_eos(llm):
    greedy = llm.generate([_prompt(4, 10)], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    stop_at = greedy.token_ids[1]
    held = llm.generate(
        [_prompt(4, 10)], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_at], min_tokens=5)
    )[0]
    assert len(held.token_ids) >= 5 and stop_at not in held.token_ids[:5]
    assert held.token_ids[0] == greedy.token_ids[0] and held.token_ids[1] != stop_at
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_stop_string_is_cut_from_the_text(llm):
    greedy = llm.generate([_prompt(5, 10)], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    text = greedy.text
    stop = next(
        (
            text[i : i + 2]
            for i in range(3, len(text) - 2)
            if "\ufffd" not in text[i : i + 2] and text[i : i + 2].strip()
        ),
        None,
    )
    if stop is None:
        pytest.skip("random model produced no usable text")
    out = llm.generate([_prompt(5, 10)], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text


def test_logprobs_are_reported_per_token(llm):
    out = llm.generate([_prompt(6, 10)], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert len(entry.top) == 3
        assert entry.top[0][0] == token  # greedy: the chosen token is the most likely
        assert entry.token_logprob == pytest.approx(entry.top[0][1])


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "prompt is empty"),
        ("", "prompt is empty"),
        ([1, 2, VOCAB], f"token_ids[2] = {VOCAB} is outside the vocabulary"),
        ([1, -1], "token_ids[1] = -1 is outside the vocabulary"),
        (list(range(3, 131)), "context window (max_model_len) is 128"),
    ],
)
def test_bad_prompts_raise_clear_errors_and_leave_nothing_behind(llm, prompt, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        llm.generate([_prompt(7, 5), prompt], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    llm.engine.check_idle_integrity()


def test_bad_sampling_values_name_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_abort_at_any_point_frees_everything(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    engine.add_request("waiting", _prompt(8, 40), params)
    engine.add_request("running", _prompt(9, 20), params)
    engine.step()
    engine.step()
    assert engine.abort("running").finish_reason == "abort"
    assert engine.abort("waiting").finish_reason == "abort"
    assert engine.abort("unknown") is None
    assert not engine.has_unfinished()
    engine.check_idle_integrity()
    assert engine.block_pool.all_free()


def test_producer_blocks_continue_on_a_consumer_exactly(checkpoints):
    """The disaggregation seam without a network: prefill on one engine, copy the held
    blocks into the blocks a second engine allocated, and decode there."""
    path, _ = checkpoints("deepseek_v3")
    prompt = _prompt(10, 37)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = LLM(str(path)).generate([prompt], params)[0].token_ids

    producer, consumer = LLM(str(path)).engine, LLM(str(path)).engine
    producer.add_request("r", prompt, params, kv_role=KVRole.PRODUCER, pin_s=30.0)
    first = None
    while first is None:
        first = next((o for o in producer.step().outputs if o.finished), None)
    assert first.finish_reason == "kv_transfer" and first.token_ids == expected[:1]
    held = first.held_block_ids

    consumer.add_request("r", prompt, params, kv_role=KVRole.CONSUMER)
    step = consumer.step()
    assert step.outputs == [] and [a[0] for a in step.awaiting_kv] == ["r"]
    _, local_blocks, num_cached = step.awaiting_kv[0]
    assert num_cached == 0 and len(local_blocks) == len(held)
    consumer.kv_cache.data[local_blocks] = producer.kv_cache.data[held]
    producer.kv_sent("r")
    producer.check_idle_integrity()
    assert producer.block_pool.all_free()

    consumer.kv_received("r", first.token_ids[0])
    tokens = []
    while consumer.has_unfinished():
        for output in consumer.step().outputs:
            tokens = output.token_ids
    assert tokens == expected
    consumer.check_idle_integrity()
    assert consumer.block_pool.all_free()


def test_loading_errors_name_the_file_and_tensor(checkpoints, tmp_path):
    from pdserve.model.weights import CheckpointError

    path, hf_model = checkpoints("llama")
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((path / name).read_bytes())
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    prompt = _prompt(11, 9)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    assert (
        LLM(str(sharded)).generate([prompt], params)[0].token_ids
        == LLM(str(path)).generate([prompt], params)[0].token_ids
    )

    shard = sorted(set(index["weight_map"].values()))[-1]
    (sharded / shard).rename(tmp_path / "moved")
    with pytest.raises(CheckpointError, match=f"shard {shard}.*missing"):
        LLM(str(sharded))

    config = json.loads((path / "config.json").read_text())
    bad = tmp_path / "bad_arch"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(bad))

    wrong = tmp_path / "wrong_shape"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    (wrong / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape \[96, 64\], expected \[128, 64\]",
    ):
        LLM(str(wrong))


def test_consumer_ends_at_once_when_the_first_token_already_finishes_it(checkpoints):
    path, _ = checkpoints("llama")
    consumer = LLM(str(path)).engine
    consumer.add_request("r", _prompt(12, 20), SamplingParams(max_tokens=1, temperature=0), kv_role=KVRole.CONSUMER)
    assert [a[0] for a in consumer.step().awaiting_kv] == ["r"]
    final = consumer.kv_received("r", 42)
    assert final is not None and final.finished and final.finish_reason == "length" and final.token_ids == [42]
    assert not consumer.has_unfinished()
    consumer.check_idle_integrity()
    assert consumer.block_pool.all_free()


def test_the_engine_leaves_stop_strings_to_its_caller(llm):
    """LLMEngine speaks token ids: a stop string does not end its request; LLM ends it at the
    token that completed the stop string, aborts it in the engine, and cuts the text."""
    prompt, stop = stop_after_the_first_token(llm, completes=True)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[stop])
    engine = llm.engine
    engine.add_request("ids", prompt, params)
    final = None
    while final is None:
        final = next((o for o in engine.step().outputs if o.finished), None)
    assert final.finish_reason == "length" and len(final.token_ids) == 8
    assert not hasattr(final, "text")

    out = llm.generate([prompt], params)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop)]
    assert 2 <= len(out.token_ids) < 8 and out.token_ids == full.token_ids[: len(out.token_ids)]
    assert stop not in llm.tokenizer.decode(out.token_ids[:-1])  # the stop was completed by the last token
    assert len(out.logprobs) == len(out.token_ids)
    assert not engine.has_unfinished()
    engine.check_idle_integrity()
    assert engine.block_pool.all_free()


@pytest.mark.parametrize("with_stop", [False, True])
def test_stream_yields_what_generate_returns(llm, with_stop):
    prompt, stop = stop_after_the_first_token(llm, completes=True)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[stop] if with_stop else None)
    chunks = list(llm.stream(prompt, params))
    want = llm.generate([prompt], params)[0]
    assert [c.output is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].output == want
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    assert "".join(c.text for c in chunks) == want.text
    assert want.finish_reason == ("stop" if with_stop else "length")


def test_closing_a_stream_early_aborts_its_request(llm):
    stream = llm.stream(_prompt(13, 20), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    next(stream)
    assert llm.engine.has_unfinished()
    stream.close()
    assert not llm.engine.has_unfinished()
    llm.engine.check_idle_integrity()
