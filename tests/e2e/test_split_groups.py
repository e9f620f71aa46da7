"""Groups whose ranks are started separately, as on several hosts: rank 0 runs as a worker
(under the local cluster's supervisor) and rank 1 as its own ``pdserve decode`` process that
finds rank 0 at its leader address. Here both sit on this host's loopback; the same code runs
them on separate hosts (tests/e2e/test_groups_across_hosts.py). Real etcd, processes, gRPC,
NIXL; transformers as the reference."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

from pdserve.distributed.parallel_config import ParallelConfig
from pdserve.distributed.placement import GroupPlacement
from pdserve.launch.etcd_process import free_port
from tests.e2e.deployment import Deployment
from tests.utils.checkpoints import VOCAB, reference_greedy

pytestmark = pytest.mark.slow


def start_rank(model: str, etcd: str, port: int, index: int, *options: str) -> subprocess.Popen:
    """Rank ``index`` of a decode group as a user starts it on another host: same options as
    rank 0, plus where rank 0 is and which rank this one is."""
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve", "decode", "--model", model, "--etcd", etcd, "--num-threads", "1"]
        + ["--leader-address", f"127.0.0.1:{port}", "--group-size", "2", "--group-index", str(index), *options],
    )


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def serve_split(checkpoints, etcd_url, arch: str, parallel: ParallelConfig, options: tuple[str, ...]):
    path, hf_model = checkpoints(arch)
    port = free_port()
    rank1 = start_rank(str(path), etcd_url, port, 1, *options)
    try:
        deployment = Deployment(
            str(path),
            etcd_url,
            prefill=1,
            decode=1,
            model_name=f"split-{arch}",
            disaggregation="always",
            decode_fields={
                "parallel": parallel,
                "placement": GroupPlacement(leader_host="127.0.0.1", leader_port=port, group_size=2, group_index=0),
            },
        )
    except BaseException:
        rank1.kill()
        rank1.wait()
        raise
    return deployment, hf_model, rank1, port


def check_greedy(deployment: Deployment, hf_model, batch: list[list[int]]) -> None:
    compared = 0
    for prompt in batch:
        result = deployment.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
        reference, num_clear = reference_greedy(hf_model, prompt, 8)
        assert result["token_ids"][:num_clear] == reference[:num_clear], prompt
        compared += num_clear
        assert result["final"].breakdown.kv_transfer_bytes > 0
    assert compared >= len(batch) * 4


def stop(deployment: Deployment, rank1: subprocess.Popen) -> int:
    """Stop the deployment; rank 1, told by rank 0, stops with it. Rank 1's exit status."""
    deployment.close()
    try:
        return rank1.wait(60)
    finally:
        if rank1.poll() is None:
            rank1.kill()
            rank1.wait()


def test_a_tensor_parallel_group_with_its_rank_started_separately(checkpoints, etcd_url):
    deployment, hf_model, rank1, _ = serve_split(
        checkpoints, etcd_url, "llama", ParallelConfig(tensor_parallel_size=2), ("--tensor-parallel-size", "2")
    )
    try:
        decode = next(w for w in deployment.registered() if w.role == "decode")
        assert decode.tensor_parallel_size == 2
        check_greedy(deployment, hf_model, prompts(3, (9, 17, 33)))
    finally:
        stop(deployment, rank1)  # raises if rank 1 outlives its stopped group


def test_a_data_parallel_group_with_its_rank_started_separately(checkpoints, etcd_url):
    parallel = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)
    options = ("--data-parallel-size", "2", "--enable-expert-parallel")
    deployment, hf_model, rank1, _ = serve_split(checkpoints, etcd_url, "deepseek_v3", parallel, options)
    try:
        deadline = time.monotonic() + 60
        while len([w for w in deployment.registered() if w.role == "decode"]) < 2:
            assert time.monotonic() < deadline, "rank 1 never registered"
            time.sleep(0.2)
        ids = sorted(w.worker_id for w in deployment.registered() if w.role == "decode")
        assert ids[1] == f"{ids[0]}-dp1", ids
        check_greedy(deployment, hf_model, prompts(5, (9, 17, 24, 12)))
    finally:
        status = stop(deployment, rank1)
    assert status == 0, "rank 1 should drain and stop when rank 0 does"


def test_a_lost_rank_fails_its_group_and_a_lost_leader_stops_its_rank(checkpoints, etcd_url):
    """Either side's death ends the group within seconds: rank 0 leaves the registry and exits
    non-zero when rank 1 dies; rank 1 exits non-zero when rank 0 dies. Nothing waits on."""
    deployment, _, rank1, port = serve_split(
        checkpoints, etcd_url, "llama", ParallelConfig(tensor_parallel_size=2), ("--tensor-parallel-size", "2")
    )
    try:
        leader = deployment.worker("decode")
        rank1.kill()
        rank1.wait(10)
        status = deployment.run(leader.process.wait(), timeout=30)
        assert status == 1
        deployment.wait_registered(lambda ws: all(w.role != "decode" for w in ws), 10, "the group leaves the registry")
        # The group again, its rank 1 first; then rank 0 dies under it.
        rank1 = start_rank(str(checkpoints("llama")[0]), etcd_url, port, 1, "--tensor-parallel-size", "2")
        leader = deployment.restart(leader)
        deployment.wait_registered(lambda ws: any(w.role == "decode" for w in ws), 30, "the group serves again")
        deployment.kill(leader)
        assert rank1.wait(30) == 1
    finally:
        stop(deployment, rank1)


def test_a_hung_rank_fails_its_group_by_the_collective_deadline(checkpoints, etcd_url):
    """Rank 1 stopped (SIGSTOP: alive, its connections open, silent) while the group is idle:
    rank 0 hears nothing from it for --collective-timeout and fails the group; rank 1, let go
    again, finds its leader gone."""
    parallel = ParallelConfig(tensor_parallel_size=2, collective_timeout_s=8)
    deployment, _, rank1, _ = serve_split(
        checkpoints, etcd_url, "llama", parallel, ("--tensor-parallel-size", "2", "--collective-timeout", "8")
    )
    try:
        leader = deployment.worker("decode")
        rank1.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        assert deployment.run(leader.process.wait(), timeout=60) == 1
        assert 8 <= time.monotonic() - stopped < 8 + 15
        deployment.wait_registered(lambda ws: all(w.role != "decode" for w in ws), 10, "the group leaves the registry")
        rank1.send_signal(signal.SIGCONT)
        assert rank1.wait(30) == 1
    finally:
        stop(deployment, rank1)
