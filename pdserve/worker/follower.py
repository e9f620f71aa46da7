"""A worker process that is rank 1..N-1 of a group across hosts (``pdserve prefill|decode`` with
a placement whose index is not 0).

Contract: ``run_follower`` joins rank 0's group at the placement's leader address
(``join_as_follower``) and runs the program rank 0 names for its ranks, exactly as a child rank
of a one-host group runs it: a tensor-parallel rank (``pdserve.worker.group.rank_main``), or a
rank of a data-parallel group (``pdserve.worker.data_parallel``): a worker of its own, serving
at this process's addresses, or one of such a worker's tensor-parallel ranks. Its exit status
is the program's; it raises ``RankFailed`` when the group cannot be joined, and ``ValueError``
when this process's group settings do not match rank 0's.
"""

from __future__ import annotations

from pdserve.distributed.errors import RankFailed
from pdserve.distributed.follower import join_as_follower
from pdserve.worker import data_parallel
from pdserve.worker.config import WorkerConfig
from pdserve.worker.group import rank_main


def run_follower(config: WorkerConfig) -> int:
    placement = config.placement
    assert placement is not None and not placement.is_leader
    joined = join_as_follower(placement, config.reachable_host, config.parallel.rendezvous_timeout_s)
    program = joined[0].entry_module
    if program == data_parallel.__name__:
        return data_parallel.main(joined, own=config)
    if program == rank_main.__name__:
        return rank_main.main(joined)
    raise RankFailed(f"the leader at {placement.leader_address} runs its ranks as {program!r}, unknown here")
