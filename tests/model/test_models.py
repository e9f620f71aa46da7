"""Greedy tokens of every architecture against transformers (float32), through the paths
that matter: batches of mixed lengths across block boundaries, chunked prefill, prefix-cache
hits, and preemption by recompute."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.utils.checkpoints import ARCHITECTURES, VOCAB, reference_greedy

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _assert_matches_reference(hf_model, prompts, outputs, max_tokens: int = 10) -> None:
    compared = 0
    for prompt, output in zip(prompts, outputs):
        reference, num_clear = reference_greedy(hf_model, prompt, max_tokens)
        assert output.token_ids[:num_clear] == reference[:num_clear], f"prompt of {len(prompt)} tokens"
        compared += num_clear
    assert compared >= len(prompts) * max_tokens // 2, "too many near-ties: the comparison proves little"


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_mixed_batch_with_chunked_prefill_matches_transformers(checkpoints, arch, kernels):
    path, hf_model = checkpoints(arch)
    # A 24-token budget splits the 40- and 33-token prompts into chunks; 16 and 17 tokens
    # end exactly on and just past a block boundary. Both CPU backends: the C kernels and
    # oneDNN linears ("cpu", the default here) and the plain torch reference ("torch").
    llm = LLM(str(path), max_num_batched_tokens=24, max_num_seqs=8, kernels=kernels)
    assert llm.engine.backend.name == kernels
    prompts = _prompts(1, [5, 16, 17, 40, 33, 1])
    outputs = llm.generate(prompts, GREEDY)
    _assert_matches_reference(hf_model, prompts, outputs)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 10 for o in outputs)
    llm.engine.check_idle_integrity()
    assert llm.engine.block_pool.all_free()


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "qwen3_moe"])
def test_shared_prefix_hits_the_cache_and_matches_transformers(checkpoints, arch):
    path, hf_model = checkpoints(arch)
    llm = LLM(str(path))
    prefix = _prompts(2, [48])[0]
    first = llm.generate([prefix + [5, 6, 7]], GREEDY)
    assert first[0].num_cached_tokens == 0
    prompts = [prefix + tail for tail in _prompts(3, [3, 9, 20])]
    outputs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outputs] == [48, 48, 48]
    _assert_matches_reference(hf_model, prompts, outputs)
    llm.engine.check_idle_integrity()


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2_lite"])
def test_preemption_under_a_small_kv_budget_loses_nothing(checkpoints, arch):
    path, hf_model = checkpoints(arch)
    probe = LLM(str(path))
    block_bytes = probe.engine.kv_cache_spec.bytes_per_block
    # 12 blocks of 16 tokens for 6 requests that need up to 4 blocks each.
    llm = LLM(str(path), kv_cache_memory=12 * block_bytes, max_num_seqs=6)
    prompts = _prompts(4, [30, 41, 25, 37, 44, 20])
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(len(o.token_ids) == 14 for o in outputs)
    _assert_matches_reference(hf_model, prompts, outputs, max_tokens=14)
    llm.engine.check_idle_integrity()
    assert llm.engine.block_pool.all_free()


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_bfloat16_matches_transformers_in_bfloat16(checkpoints, arch):
    path, hf_model = checkpoints(arch)
    prompts = _prompts(5, [12, 30, 7, 19, 41, 25])
    outputs = LLM(str(path), dtype="bfloat16").generate(prompts, GREEDY)
    hf_half = type(hf_model).from_pretrained(path, dtype=torch.bfloat16).eval()
    compared = 0
    for prompt, output in zip(prompts, outputs):
        # bfloat16 rounding differs with the order of operations: compare only clear wins.
        reference, num_clear = reference_greedy(hf_half, prompt, 10, margin=0.05)
        assert output.token_ids[:num_clear] == reference[:num_clear]
        compared += num_clear
    assert compared >= 10, "too few clear-margin tokens to compare: the test would prove nothing"


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3"])
def test_the_last_layer_feeds_forward_only_the_rows_that_sample(checkpoints, arch):
    path, _ = checkpoints(arch)
    # A 24-token budget: the 40-token prompt's first chunk samples nothing, and steps with
    # decodes and a chunk sample some rows of many.
    llm = LLM(str(path), max_num_batched_tokens=24, max_num_seqs=4)
    model, runner = llm.engine.runner.model, llm.engine.runner
    last = model.layers[-1]
    fed: list[int] = []
    feed_forward = last.feed_forward

    def counting(x):
        fed.append(x.shape[0])
        return feed_forward(x)

    last.feed_forward = counting
    steps = []
    execute = runner.execute

    def recording(inputs, *args, **kwargs):
        steps.append(inputs)
        return execute(inputs, *args, **kwargs)

    runner.execute = recording
    llm.generate(_prompts(6, [40, 9, 3]), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert fed == [len(inputs.sample_rows) for inputs in steps] and 0 in fed and max(fed) < 24
    whole_batches = 0
    for inputs in steps:  # a step again writes the same KV to the same slots: the cache is unchanged
        args = (inputs.input_ids, inputs.positions, runner.kv_cache, inputs.meta)
        whole = model.forward(*args)
        whole_batches += whole.shape[0] > len(inputs.sample_rows)
        torch.testing.assert_close(model.forward(*args, sample_rows=inputs.sample_rows), whole[inputs.sample_rows])
    assert whole_batches > 0
