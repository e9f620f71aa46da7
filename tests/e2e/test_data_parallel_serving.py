"""Data-parallel attention with expert parallelism served end to end (DeepSeek-V3): a prefill
worker of 2 DP ranks feeding a decode worker of 2 DP ranks, each rank a registered worker with
its own KV cache, the ranks of each sharing the experts by all-to-all and stepping together.
Real etcd, processes, gRPC, NIXL; transformers as the reference."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdserve.distributed import ParallelConfig
from tests.e2e.deployment import Deployment, rank_children
from tests.utils.checkpoints import VOCAB, reference_greedy

pytestmark = pytest.mark.slow
DP2_EP = {"parallel": ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)}
MODEL = "dp-deepseek"


@pytest.fixture(scope="module")
def groups(checkpoints, etcd_url):
    path, hf_model = checkpoints("deepseek_v3")
    deployment = Deployment(str(path), etcd_url, prefill=1, decode=1, model_name=MODEL, disaggregation="always",
                            prefill_fields=DP2_EP, decode_fields=DP2_EP)  # fmt: skip
    yield deployment, hf_model
    deployment.close()


def _idle(workers) -> bool:
    return len(workers) == 4 and all(
        w.load.kv_blocks_used == 0 and w.load.held_requests == 0 and w.load.running == 0 for w in workers
    )


def test_every_rank_registers_as_a_worker(groups):
    deployment, _ = groups
    workers = deployment.registered()
    for role in ("prefill", "decode"):
        ids = sorted(w.worker_id for w in workers if w.role == role)
        assert len(ids) == 2 and ids[1] == f"{ids[0]}-dp1", ids


def test_greedy_tokens_equal_transformers_with_kv_moved_on_every_rank(groups):
    deployment, hf_model = groups
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (9, 17, 33, 24, 40, 12, 28, 5)]
    with ThreadPoolExecutor(len(prompts)) as pool:  # at once: the router spreads them over the ranks
        results = list(pool.map(
            lambda p: deployment.generate(p, max_tokens=8, temperature=0, ignore_eos=True), prompts
        ))  # fmt: skip
    compared = 0
    for prompt, result in zip(prompts, results):
        reference, num_clear = reference_greedy(hf_model, prompt, 8)
        assert result["token_ids"][:num_clear] == reference[:num_clear], prompt
        compared += num_clear
        b = result["final"].breakdown
        assert b.disaggregated and b.kv_transfer_bytes > 0
    assert compared >= len(prompts) * 4
    served = {(r["final"].breakdown.prefill_worker, r["final"].breakdown.decode_worker) for r in results}
    assert len({p for p, _ in served}) == 2 and len({d for _, d in served}) == 2, served
    deployment.wait_registered(_idle, 15, "every block free again on every rank")


def test_a_dead_rank_takes_its_whole_group_down(checkpoints, etcd_url):
    path, _ = checkpoints("deepseek_v3")
    deployment = Deployment(str(path), etcd_url, prefill=1, decode=1, model_name=f"{MODEL}-rank-dies",
                            disaggregation="always", prefill_fields=DP2_EP, decode_fields=DP2_EP)  # fmt: skip
    try:
        worker = deployment.worker("decode")
        (rank,) = rank_children([worker.process.pid], "pdserve.worker.data_parallel")
        assert deployment.generate(list(range(3, 30)), max_tokens=4, temperature=0, ignore_eos=True)["token_ids"]
        os.kill(rank, signal.SIGKILL)
        deployment.wait_registered(lambda ws: sorted(w.role for w in ws) == ["prefill", "prefill"], 30,
                                   "both decode ranks gone from the registry")  # fmt: skip
        assert deployment.run(worker.process.wait(), timeout=60) == 1  # rank 0 failed, for a restart
        deployment.wait_registered(
            lambda ws: all(w.load.kv_blocks_used == 0 and w.load.held_requests == 0 for w in ws), 10,
            "the prefill ranks whole",
        )  # fmt: skip
    finally:
        deployment.close()
