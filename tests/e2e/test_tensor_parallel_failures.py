"""A tensor-parallel worker that loses a rank: it leaves the registry and exits, rather than
serve with a missing share of its model; the other pool stays whole. Real etcd, processes, NIXL."""

from __future__ import annotations

import os
import signal

import grpc
import pytest

from pdserve.distributed.parallel_config import ParallelConfig
from tests.e2e.deployment import Deployment, rank_children

pytestmark = pytest.mark.slow
TP2 = {"parallel": ParallelConfig(tensor_parallel_size=2)}


@pytest.mark.parametrize("role, other", [("decode", "prefill"), ("prefill", "decode")])
def test_a_worker_whose_rank_dies_stops_and_the_other_group_stays_whole(checkpoints, etcd_url, role, other):
    path = checkpoints("llama")[0]
    deployment = Deployment(
        str(path),
        etcd_url,
        prefill=1,
        decode=1,
        model_name=f"tp-llama-{role}-rank-dies",
        disaggregation="always",
        prefill_fields=TP2,
        decode_fields=TP2,
    )
    try:
        worker = deployment.worker(role)
        (rank,) = rank_children([worker.process.pid])
        served = deployment.generate(list(range(3, 30)), max_tokens=4, temperature=0, ignore_eos=True)
        assert served["final"].breakdown.kv_transfer_bytes > 0
        os.kill(rank, signal.SIGKILL)
        deployment.wait_registered(lambda ws: [w.role for w in ws] == [other], 30, f"the {role} worker gone")
        assert deployment.run(worker.process.wait(), timeout=60) is not None  # rank 0 exited too
        with pytest.raises(grpc.RpcError) as error:
            deployment.generate([1, 2, 3], max_tokens=2)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE and f"no {role} worker" in error.value.details()
        deployment.wait_registered(
            lambda ws: all(w.load.kv_blocks_used == 0 and w.load.held_requests == 0 for w in ws),
            10,
            f"the {other} group whole",
        )
    finally:
        deployment.close()
