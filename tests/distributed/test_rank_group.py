"""RankGroup's start: a child that dies before the group forms fails the start at once."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from pdserve.distributed.errors import RankFailed
from pdserve.distributed.parallel_config import ParallelConfig
from pdserve.distributed.rank_group import RankGroup


def test_a_child_that_cannot_start_fails_the_start_at_once():
    group = RankGroup(ParallelConfig(tensor_parallel_size=2), "pdserve.no_such_program", b"")
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"ranks \[1\] exited before the group formed"):
        group.start()
    assert time.monotonic() - start < 30  # not the 120 s rendezvous deadline
    assert group.processes == [] and not dist.is_initialized()
