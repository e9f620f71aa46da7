"""A rank started on its own meets rank 0 at the leader's address, or fails with an error that
names what is wrong: a leader nobody answers at, a size that differs from the leader's, an index
another process already took."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.distributed.errors import RankFailed
from pdserve.distributed.follower import join_as_follower
from pdserve.distributed.parallel_config import ParallelConfig
from pdserve.distributed.placement import GroupPlacement
from pdserve.distributed.rank_group import RankGroup
from pdserve.launch.etcd_process import free_port


def placement(port: int, size: int = 2, index: int = 1) -> GroupPlacement:
    return GroupPlacement(leader_host="127.0.0.1", leader_port=port, group_size=size, group_index=index)


def test_a_leader_nobody_answers_at_fails_the_rank_at_its_deadline():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(RankFailed, match=f"leader at 127.0.0.1:{port} could not be reached within 2 s"):
        join_as_follower(placement(port), "127.0.0.1", 2.0)
    assert time.monotonic() - started < 10


class Leader:
    """Rank 0 of a two-rank group across hosts, waiting on a thread for a rank 1 that will not come."""

    def __init__(self, timeout_s: float = 4.0) -> None:
        self.port = free_port()
        config = ParallelConfig(tensor_parallel_size=2, rendezvous_timeout_s=timeout_s)
        self.group = RankGroup(config, "pdserve.worker.group.rank_main", b"", placement=placement(self.port, index=0))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._start)
        self.thread.start()
        while self.group.store is None:
            time.sleep(0.01)

    def _start(self) -> None:
        try:
            self.group.start()
        except BaseException as error:
            self.error = error

    def join(self) -> None:
        self.thread.join(30)
        assert isinstance(self.error, RankFailed) and f"(port {self.port})" in str(self.error), self.error


def test_a_rank_whose_group_size_differs_from_the_leaders_is_refused():
    leader = Leader()
    with pytest.raises(
        ValueError, match=f"group size 3 does not match the leader's group of 2 ranks at 127.0.0.1:{leader.port}"
    ):
        join_as_follower(placement(leader.port, size=3), "127.0.0.1", 5.0)
    leader.join()


def test_a_second_process_with_a_taken_index_is_refused():
    leader = Leader()
    assert leader.group.store is not None
    leader.group.store.add("pdserve/claim/1", 1)  # what the first rank 1 did
    with pytest.raises(RankFailed, match="another process already joined the group at .* as rank 1"):
        join_as_follower(placement(leader.port), "127.0.0.1", 5.0)
    leader.join()


def test_an_index_past_the_leaders_group_waits_for_a_place_that_never_comes():
    leader = Leader(timeout_s=6.0)
    with pytest.raises(RankFailed, match="has no place for rank 2"):
        join_as_follower(placement(leader.port, size=3, index=2), "127.0.0.1", 2.0)
    leader.join()
