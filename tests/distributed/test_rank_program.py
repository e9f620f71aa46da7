"""run_rank, the skeleton of every child rank's program, in a real group of two ranks over gloo:
the payload reaches the body, the thread count is set, and each way out has its exit status."""

from __future__ import annotations

import msgspec
import pytest
import torch
import torch.distributed as dist

from pdserve.distributed.parallel_config import ParallelConfig
from pdserve.distributed.rank_group import RankGroup, start_group
from tests.distributed.probe_rank import PROBE_STATUS, Probe

_PROGRAM = "tests.distributed.probe_rank"


def _start(probe: Probe) -> RankGroup:
    group = start_group(ParallelConfig(tensor_parallel_size=2), _PROGRAM, msgspec.msgpack.encode(probe), "cpu")
    assert group is not None
    return group


def _exit_status(group: RankGroup) -> int:
    try:
        return group.processes[0].wait(timeout=60)
    finally:
        group.close()


@pytest.mark.slow
def test_the_body_gets_its_payload_and_threads_and_its_status_is_the_exit_status():
    threads = torch.get_num_threads() + 1  # a count the child would not have by default
    group = _start(Probe("return", num_threads=threads))
    seen = torch.tensor([0])
    try:
        dist.all_reduce(seen)  # rank 0 adds nothing: the sum is the child's thread count
    finally:
        status = _exit_status(group)
    assert seen.item() == threads
    assert status == PROBE_STATUS
    assert not dist.is_initialized()


@pytest.mark.slow
def test_a_rank_whose_group_failed_says_it_stops_and_exits_1(capfd: pytest.CaptureFixture[str]):
    assert _exit_status(_start(Probe("rank_failed"))) == 1
    err = capfd.readouterr().err
    assert "rank 1 stops: rank 0 is gone (probe)" in err
    assert "Traceback" not in err  # nothing of this rank's own to report


@pytest.mark.slow
def test_a_rank_that_breaks_logs_its_traceback_and_exits_1(capfd: pytest.CaptureFixture[str]):
    assert _exit_status(_start(Probe("raise"))) == 1
    err = capfd.readouterr().err
    assert "rank 1 failed" in err and "ValueError: probe breaks" in err
