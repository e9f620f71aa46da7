"""Multi-rank groups (real processes over gloo) give transformers' greedy tokens: tensor
parallelism, expert parallelism over tensor- and data-parallel ranks, expert-parallel load
balancing, through mixed batches, chunked prefill, prefix hits and preemption."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.distributed.errors import RankFailed
from pdserve.model.nn.expert_placement import ExpertPlacement
from pdserve.model.nn.moe import MoE
from tests.model.test_models import _assert_matches_reference, _prompts
from tests.utils.checkpoints import VOCAB

# A rank group of processes per test (over a minute in all): the full run's, not the quick tier's.
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _moe_placements(llm: LLM) -> list[tuple[int, ...]]:
    return [
        layer.feed_forward.placement.slot_experts
        for layer in llm.engine.model.layers
        if isinstance(layer.feed_forward, MoE)
    ]


GROUPS = [
    ("llama", dict(tensor_parallel_size=2)),
    ("qwen2", dict(tensor_parallel_size=2)),  # biases on q, k, v: column-parallel biases
    ("qwen3", dict(tensor_parallel_size=2)),  # per-head q/k norms on each rank's heads
    ("mixtral", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ("qwen3_moe", dict(tensor_parallel_size=2)),  # experts split by intermediate size
    ("deepseek_v3", dict(data_parallel_size=2, enable_expert_parallel=True)),
    ("deepseek_v2_lite", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    # Tensor-parallel attention (MLA heads split) inside each data-parallel rank, experts over all 4.
    ("deepseek_v3", dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)),
]


# Expert-parallel groups with redundant slots: 8 experts + redundant ones deal evenly over the ranks.
BALANCED = [
    ("deepseek_v3", dict(data_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=2)),
    ("mixtral", dict(tensor_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=2)),
    # The agreed rebalance reaches the tensor-parallel ranks of each data-parallel rank with its plan.
    (
        "deepseek_v3",
        dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=4),
    ),
]


@pytest.mark.parametrize("arch,parallel", GROUPS, ids=[f"{a}-{'-'.join(map(str, p.values()))}" for a, p in GROUPS])
def test_group_matches_transformers_with_chunked_prefill(checkpoints, arch, parallel):
    path, hf_model = checkpoints(arch)
    prompts = _prompts(1, [5, 16, 17, 40, 33, 1])
    with LLM(str(path), max_num_batched_tokens=24, max_num_seqs=8, **parallel) as llm:
        outputs = llm.generate(prompts, GREEDY)
        _assert_matches_reference(hf_model, prompts, outputs)
        assert all(o.finish_reason == "length" and len(o.token_ids) == 10 for o in outputs)
        llm.engine.check_idle_integrity()
        assert llm.engine.block_pool.all_free()


def test_four_ranks_replicate_the_two_kv_heads(checkpoints):
    path, hf_model = checkpoints("llama")  # 4 query heads, 2 KV heads
    prompts = _prompts(2, [7, 19])
    with LLM(str(path), tensor_parallel_size=4) as llm:
        assert llm.engine.kv_cache_spec.num_kv_heads == 1
        _assert_matches_reference(hf_model, prompts, llm.generate(prompts, GREEDY))


def test_prefix_hits_and_preemption_in_a_tensor_parallel_group(checkpoints):
    path, hf_model = checkpoints("llama")
    probe = LLM(str(path), tensor_parallel_size=2)
    block_bytes = probe.engine.kv_cache_spec.bytes_per_block
    probe.close()
    with LLM(str(path), tensor_parallel_size=2, kv_cache_memory=12 * block_bytes, max_num_seqs=6) as llm:
        prefix = _prompts(2, [48])[0]
        llm.generate([prefix + [5, 6, 7]], GREEDY)
        hits = [prefix + tail for tail in _prompts(3, [3, 9])]
        outputs = llm.generate(hits, GREEDY)
        assert [o.num_cached_tokens for o in outputs] == [48, 48]
        _assert_matches_reference(hf_model, hits, outputs)
        prompts = _prompts(4, [30, 41, 25, 37, 44, 20])
        params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
        outputs = llm.generate(prompts, params)
        assert llm.engine.scheduler.num_preemptions > 0
        _assert_matches_reference(hf_model, prompts, outputs, max_tokens=14)
        llm.engine.check_idle_integrity()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_data_parallel_rank_without_requests_steps_with_its_peers(checkpoints, tp):
    path, hf_model = checkpoints("deepseek_v3")
    prompt = _prompts(5, [21])
    with LLM(str(path), data_parallel_size=2, tensor_parallel_size=tp, enable_expert_parallel=True) as llm:
        # One prompt: data-parallel rank 1 has nothing, yet must join every step's all-to-all
        # (with tp 2, both of its ranks: its leader sends its other rank idle plans).
        _assert_matches_reference(hf_model, prompt, llm.generate(prompt, GREEDY))
        with pytest.raises(ValueError, match=r"prompts\[1\].*outside the vocabulary"):
            llm.generate([[5, 6], [VOCAB + 3]], GREEDY)  # refused before any rank starts
        # The group still serves after the refusal.
        _assert_matches_reference(hf_model, prompt, llm.generate(prompt, GREEDY))


@pytest.mark.parametrize("arch,parallel", BALANCED, ids=[f"{a}-{'-'.join(map(str, p.values()))}" for a, p in BALANCED])
def test_load_balancing_moves_experts_and_keeps_the_tokens(checkpoints, arch, parallel):
    path, hf_model = checkpoints(arch)
    prompts = _prompts(6, [5, 16, 17, 40, 33, 1])
    with LLM(str(path), eplb_interval_steps=3, **parallel) as llm:
        before = _moe_placements(llm)
        outputs = llm.generate(prompts, GREEDY)
        after = _moe_placements(llm)
        # Random routing is skewed: the hot experts got the redundant slots, mid-generation.
        assert after != before
        _assert_matches_reference(hf_model, prompts, outputs)
        _assert_matches_reference(hf_model, prompts, llm.generate(prompts, GREEDY))


def test_a_dead_rank_fails_the_group_without_hanging(checkpoints):
    path, _ = checkpoints("llama")
    llm = LLM(str(path), tensor_parallel_size=2)
    try:
        (follower,) = llm._group.processes
        long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        threading.Timer(1.0, os.kill, (follower.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(RankFailed):
            llm.generate(_prompts(7, [8] * 8), long)
        assert time.monotonic() - start < 60
        follower.wait(timeout=10)  # its sockets close a moment before it can be reaped
        with pytest.raises(RankFailed, match=r"ranks \[1\]"):
            llm.generate(_prompts(7, [8]), GREEDY)
        llm.engine.check_idle_integrity()  # the failed requests were aborted: no block leaked
    finally:
        llm.close()


def test_placement_gives_hot_experts_replicas_on_other_ranks():
    placement = ExpertPlacement.balanced(8, 2, num_redundant=2)
    assert sorted(placement.slot_experts) == sorted([*range(8), 0, 1])
    load = torch.tensor([100, 1, 1, 1, 1, 1, 1, 60])
    hot = placement.rebalanced(load)
    table, counts = hot.replica_table()
    assert counts[0] == 2 and counts[7] == 2
    # Each hot expert's two replicas sit on different ranks.
    for expert in (0, 7):
        assert {int(slot) // hot.slots_per_rank for slot in table[expert, :2]} == {0, 1}
    assert hot.rebalanced(load) == hot  # stable: the same load keeps the placement


def test_placement_refuses_slots_that_do_not_divide():
    with pytest.raises(ValueError, match="must divide by the 2 expert-parallel ranks"):
        ExpertPlacement.balanced(8, 2, num_redundant=1)


@pytest.mark.parametrize("arch,parallel", BALANCED, ids=[f"{a}-{'-'.join(map(str, p.values()))}" for a, p in BALANCED])
def test_load_balancing_on_demand(checkpoints, arch, parallel):
    path, hf_model = checkpoints(arch)
    prompts = _prompts(8, [12, 30, 7, 21])
    with LLM(str(path), **parallel) as llm:
        before = _moe_placements(llm)
        _assert_matches_reference(hf_model, prompts, llm.generate(prompts, GREEDY))
        assert _moe_placements(llm) == before  # no period: nothing moves unasked
        llm.rebalance_experts()
        outputs = llm.generate(prompts, GREEDY)  # its first step re-places them
        assert _moe_placements(llm) != before
        _assert_matches_reference(hf_model, prompts, outputs)
    with pytest.raises(ValueError, match="needs enable_expert_parallel"):
        LLM(str(path)).rebalance_experts()
