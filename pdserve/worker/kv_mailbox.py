"""Where a decode worker's pending Decode calls receive their ``KVReady``.

A Decode call may open while its prompt is still being computed (``KVSource.pending``): it
waits here for the blocks and the first token, sent by the prefill worker the moment they are
ready and, if that message was lost, by the frontend. The first delivery is used; a second is
a repeat. A delivery may also come before its call (a short prompt, a slow call): it is kept
``keep_s`` for the call to claim, then dropped.

Deliveries are keyed by request id *and* prefill worker, so a message meant for one prefill
attempt never feeds a call waiting on another.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass

from pdserve.v1 import worker_pb2

_Key = tuple[str, str]  # (request id, prefill worker id)


@dataclass
class _Slot:
    expires_at: float
    source: worker_pb2.KVSource | None = None  # delivered, not yet claimed
    waiter: asyncio.Future[worker_pb2.KVSource] | None = None
    claimed: bool = False  # a delivery reached its call: later ones are repeats


class KVMailbox:
    """Attributes:
    keep_s: how long an unclaimed delivery, or the memory of a claimed one, is kept.
    max_slots: the most requests remembered at once; the oldest go first beyond it.
    """

    def __init__(self, keep_s: float = 60.0, max_slots: int = 10_000) -> None:
        self.keep_s = keep_s
        self.max_slots = max_slots
        self._slots: OrderedDict[_Key, _Slot] = OrderedDict()  # oldest first

    def deliver(self, request_id: str, source: worker_pb2.KVSource) -> bool:
        """Hand ``source`` to its call, or keep it for the call; False for a repeat."""
        self._prune()
        key = (request_id, source.worker_id)
        slot = self._slots.get(key)
        if slot is None:
            self._slots[key] = _Slot(time.monotonic() + self.keep_s, source=source)
            return True
        if slot.claimed or slot.source is not None:
            return False
        assert slot.waiter is not None
        slot.claimed = True
        slot.waiter.set_result(source)
        return True

    async def receive(self, request_id: str, worker_id: str, timeout_s: float) -> worker_pb2.KVSource:
        """The delivery for ``request_id`` from ``worker_id``; TimeoutError after ``timeout_s``."""
        self._prune()
        key = (request_id, worker_id)
        slot = self._slots.get(key)
        if slot is not None and slot.source is not None:
            slot.claimed, source, slot.source = True, slot.source, None
            return source
        if slot is not None:  # a second call for one request, or a claimed one: not this call's to take
            raise ValueError(f"request {request_id!r} already waits for, or took, its KV from {worker_id!r}")
        waiter: asyncio.Future[worker_pb2.KVSource] = asyncio.get_running_loop().create_future()
        slot = self._slots[key] = _Slot(time.monotonic() + self.keep_s, waiter=waiter)
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        finally:
            slot.waiter = None
            slot.claimed = True  # a delivery after the call gave up or ended is a repeat too
            slot.expires_at = time.monotonic() + self.keep_s
            self._slots.move_to_end(key)  # the slots stay in the order they expire

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def num_waiting(self) -> int:
        """Calls waiting for their delivery now."""
        return sum(slot.waiter is not None for slot in self._slots.values())

    def _prune(self) -> None:
        """Forget expired slots nobody waits on, and the oldest beyond ``max_slots``."""
        now = time.monotonic()
        doomed: list[_Key] = []
        for key, slot in self._slots.items():
            if slot.waiter is not None:
                continue
            if slot.expires_at > now and len(self._slots) - len(doomed) < self.max_slots:
                break
            doomed.append(key)
        for key in doomed:
            del self._slots[key]
