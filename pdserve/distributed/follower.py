"""A rank of a group across hosts, started on its own: it meets rank 0 at the leader's address.

Contract: ``join_as_follower`` connects to rank 0's store at the placement's address (retrying
until the rendezvous deadline, then ``RankFailed`` naming the address), claims its index
(a second process with the same index is refused with ``RankFailed``), reads the
``RankStart`` rank 0 left for it, checks that its own idea of the group matches rank 0's
(``ValueError`` naming both sizes), pins its collectives to the interface of ``own_host``, and
joins the group. On return the rank is in the group exactly as a child rank is after
``child_start``, and a daemon thread watches rank 0: when rank 0 asks the group to stop
(``STOP_KEY``) the process gets SIGTERM, as a child does; when rank 0's store is gone the
process exits with status 1 at once, since nobody is left to tear it down.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from datetime import timedelta

import msgspec
import torch.distributed as dist

from pdserve.distributed.errors import RankFailed
from pdserve.distributed.interfaces import pin_collectives_to
from pdserve.distributed.parallel_state import ParallelState
from pdserve.distributed.placement import GroupPlacement
from pdserve.distributed.rank_group import STOP_KEY, RankStart, join_group, joined_key, start_key

logger = logging.getLogger("pdserve.distributed")

# How often a follower looks for rank 0's stop (and notices rank 0 gone).
_WATCH_INTERVAL_S = 0.5


def join_as_follower(placement: GroupPlacement, own_host: str, timeout_s: float) -> tuple[RankStart, ParallelState]:
    """Join the group of ``placement`` as rank ``placement.group_index`` (see the module's contract)."""
    deadline = time.monotonic() + timeout_s
    _wait_reachable(placement, deadline, timeout_s)
    store = _connect(placement, deadline)
    rank = placement.group_index
    if store.add(f"pdserve/claim/{rank}", 1) > 1:
        raise RankFailed(f"another process already joined the group at {placement.leader_address} as rank {rank}")
    try:
        store.wait([start_key(rank)], timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
    except Exception as error:
        raise RankFailed(
            f"the leader at {placement.leader_address} has no place for rank {rank} "
            f"(is its group smaller than {placement.group_size}?): {error}"
        ) from error
    start = msgspec.msgpack.decode(store.get(start_key(rank)), type=RankStart)
    if start.config.world_size != placement.group_size:
        raise ValueError(
            f"group size {placement.group_size} does not match the leader's group of {start.config.world_size} ranks "
            f"at {placement.leader_address}"
        )
    _watch_leader(placement)
    pin_collectives_to(own_host)
    store.set(joined_key(rank), "1")
    return start, join_group(rank, start.config, store, start.device)


def _wait_reachable(placement: GroupPlacement, deadline: float, timeout_s: float) -> None:
    """Until the leader's port accepts a connection: the leader may start after its ranks."""
    while True:
        try:
            socket.create_connection((placement.leader_host, placement.leader_port), timeout=1.0).close()
            return
        except OSError as error:
            if time.monotonic() > deadline:
                raise RankFailed(
                    f"the group's leader at {placement.leader_address} could not be reached within "
                    f"{timeout_s:.0f} s: {error}"
                ) from None
            time.sleep(0.2)


def _connect(placement: GroupPlacement, deadline: float) -> dist.TCPStore:
    remaining = timedelta(seconds=max(deadline - time.monotonic(), 1.0))
    try:
        return dist.TCPStore(placement.leader_host, placement.leader_port, is_master=False, timeout=remaining)
    except Exception as error:
        raise RankFailed(f"the group's leader at {placement.leader_address} refused the rendezvous: {error}") from error


def _watch_leader(placement: GroupPlacement) -> None:
    # A connection of its own: the rank's main thread uses the other one for the group.
    store = _connect(placement, time.monotonic() + 10.0)

    def watch() -> None:
        while True:
            try:
                stop = store.check([STOP_KEY])
            except Exception:
                logger.error("the group's leader at %s is gone: this rank exits", placement.leader_address)
                os._exit(1)
            if stop:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(_WATCH_INTERVAL_S)

    threading.Thread(target=watch, daemon=True, name="leader-watch").start()
