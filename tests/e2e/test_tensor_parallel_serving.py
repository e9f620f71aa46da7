"""Heterogeneous tensor parallelism served end to end: a prefill group of P ranks, a decode
group of D, each rank moving exactly its KV heads over real NIXL; real etcd, processes, gRPC.

The tiny Llama has 2 KV heads (4 query heads): P=2 → D=1 reads each decode rank's heads from
two prefill ranks; P=1 → D=2 reads each decode rank's half of one prefill rank's heads.
"""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.distributed.parallel_config import ParallelConfig
from pdserve.kvtransfer import decode_group
from tests.e2e.deployment import Deployment
from tests.e2e.prompts import shared_prefix_prompts

pytestmark = pytest.mark.slow
MODEL = "tp-llama"


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["prefill-tp2-decode-tp1", "prefill-tp1-decode-tp2"])
def groups(request, checkpoints, etcd_url):
    prefill_tp, decode_tp = request.param
    path = checkpoints("llama")[0]
    deployment = Deployment(
        str(path),
        etcd_url,
        prefill=1,
        decode=1,
        model_name=MODEL,
        disaggregation="always",
        prefill_fields={"parallel": ParallelConfig(tensor_parallel_size=prefill_tp)},
        decode_fields={"parallel": ParallelConfig(tensor_parallel_size=decode_tp)},
    )
    yield deployment, path, prefill_tp, decode_tp
    deployment.close()


def _idle(workers) -> bool:
    return len(workers) == 2 and all(
        w.load.kv_blocks_used == 0 and w.load.held_requests == 0 and w.load.running == 0 for w in workers
    )


def test_groups_register_every_rank_and_their_sizes(groups):
    deployment, _, prefill_tp, decode_tp = groups
    by_role = {w.role: w for w in deployment.registered()}
    for role, size in (("prefill", prefill_tp), ("decode", decode_tp)):
        entry = by_role[role]
        assert (entry.tensor_parallel_size, entry.num_kv_heads) == (size, 2)
        ranks = decode_group(entry.nixl)
        assert [p.layout.tp_rank for p in ranks] == list(range(size))
        assert all(p.layout.tp_size == size and p.layout.num_kv_heads == 2 // size for p in ranks)
        assert len({p.agent_name for p in ranks}) == size


def test_greedy_tokens_equal_the_offline_engine_with_kv_moved(groups):
    deployment, path, _, _ = groups
    prompts = shared_prefix_prompts(6)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expected = LLM(str(path)).generate(prompts, params)
    for prompt, want in zip(prompts, expected):
        result = deployment.generate(prompt, max_tokens=10, temperature=0, ignore_eos=True)
        assert result["token_ids"] == want.token_ids, prompt
        b = result["final"].breakdown
        assert b.disaggregated and b.prefill_worker.startswith("prefill-") and b.decode_worker.startswith("decode-")
    # A prompt that no cache holds any of: all its blocks move.
    fresh = list(range(200, 260))
    want = LLM(str(path)).generate([fresh], params)[0]
    result = deployment.generate(fresh, max_tokens=10, temperature=0, ignore_eos=True)
    assert result["token_ids"] == want.token_ids
    b = result["final"].breakdown
    assert b.kv_transfer_bytes > 0 and b.kv_transfer_ms > 0
    # Every decode rank read its own heads, once: together, the prompt's whole blocks.
    decode = next(w for w in deployment.registered() if w.role == "decode")
    whole_block = sum(peer.layout.bytes_per_block for peer in decode_group(decode.nixl))
    assert b.kv_transfer_bytes == -(-len(fresh) // decode.block_size) * whole_block
    deployment.wait_registered(_idle, 15, "every block free again on both groups")
    deployment.wait_whole(15)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_mla_groups_move_the_whole_latent_to_every_decode_rank(checkpoints, etcd_url, prefill_tp, decode_tp):
    """DeepSeek's MLA latent is the same on every rank: each decode rank reads whole blocks from
    one prefill rank, and every prefill rank frees its pin."""
    path = checkpoints("deepseek_v2_lite")[0]
    deployment = Deployment(
        str(path),
        etcd_url,
        prefill=1,
        decode=1,
        model_name=f"tp-mla-{prefill_tp}-{decode_tp}",
        disaggregation="always",
        prefill_fields={"parallel": ParallelConfig(tensor_parallel_size=prefill_tp)},
        decode_fields={"parallel": ParallelConfig(tensor_parallel_size=decode_tp)},
    )
    try:
        prompt = list(range(200, 260))
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        want = LLM(str(path)).generate([prompt], params)[0]
        result = deployment.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
        assert result["token_ids"] == want.token_ids
        decode = next(w for w in deployment.registered() if w.role == "decode")
        per_rank = -(-len(prompt) // decode.block_size) * decode_group(decode.nixl)[0].layout.bytes_per_block
        assert result["final"].breakdown.kv_transfer_bytes == decode_tp * per_rank
        deployment.wait_registered(
            lambda ws: len(ws) == 2 and all(w.load.kv_blocks_used == 0 and w.load.held_requests == 0 for w in ws),
            15,
            "every block free again on both groups",
        )
    finally:
        deployment.close()
