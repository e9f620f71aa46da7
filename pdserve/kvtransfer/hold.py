"""Prefill side: keep a finished request's blocks pinned until the decode side is done.

``BlockHolder.hold`` pins a request's blocks (the engine stopped it after the first token);
they are freed — through the ``free`` callback, normally ``KVCacheManager.free`` — when every
decode rank that reads from this prefill rank has sent its ``CompletionNotice``, or when the
hold's deadline passes (a decode worker that died or never pulled), whichever comes first,
and exactly once. A notice may arrive before ``hold`` (a decode side with the whole prefix
cached answers at once): it is kept for one default deadline and honoured by ``hold``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from pdserve.kvtransfer.agent import KVAgent
from pdserve.kvtransfer.messages import decode_notice
from pdserve.lifecycle import cancel_and_wait

logger = logging.getLogger(__name__)


class _Held:
    __slots__ = ("block_ids", "deadline", "senders", "num_expected")

    def __init__(self, block_ids: tuple[int, ...], deadline: float) -> None:
        self.block_ids = block_ids
        self.deadline = deadline
        self.senders: set[str] = set()
        self.num_expected: int | None = None  # known from the first notice

    @property
    def is_complete(self) -> bool:
        return self.num_expected is not None and len(self.senders) >= self.num_expected


class BlockHolder:
    """Pins requests' blocks on a prefill rank until their completion notices or deadline.

    ``free(request_id)`` gives the blocks back (it owns nothing else). Use from the event loop
    that runs ``agent``: ``await start()``, ``hold(...)``, ``await close()`` (which frees every
    block still held: the pool outlives no hold).
    """

    def __init__(
        self,
        agent: KVAgent,
        free: Callable[[str], None],
        *,
        deadline_s: float = 60.0,
        sweep_interval_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agent = agent
        self.free = free
        self.deadline_s = deadline_s
        self.sweep_interval_s = sweep_interval_s
        self.clock = clock
        self._held: dict[str, _Held] = {}
        self._early: dict[str, _Held] = {}  # notices that came before hold()
        self._sweeper: asyncio.Task[None] | None = None
        self.num_freed_by_notice = 0
        self.num_freed_by_deadline = 0

    async def start(self) -> None:
        """Listen for notices and start the deadline sweep."""
        # Notices are only fetched while something is held; earlier ones wait in NIXL's queue.
        self.agent.add_notification_handler(self._on_notification, lambda: bool(self._held))
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())

    async def close(self) -> None:
        """Stop listening and free every block still held."""
        self.agent.remove_notification_handler(self._on_notification)
        if self._sweeper is not None:
            await cancel_and_wait(self._sweeper)
            self._sweeper = None
        for request_id in list(self._held):
            self._release(request_id, "holder closed")
        self._early.clear()

    def hold(self, request_id: str, block_ids: Sequence[int], deadline_s: float | None = None) -> None:
        """Pin ``block_ids`` of ``request_id`` until its notices arrive or ``deadline_s`` passes."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} is already held")
        seconds = self.deadline_s if deadline_s is None else deadline_s
        entry = _Held(tuple(block_ids), self.clock() + seconds)
        early = self._early.pop(request_id, None)
        if early is not None:
            entry.senders, entry.num_expected = early.senders, early.num_expected
        self._held[request_id] = entry
        if entry.is_complete:
            self._release(request_id, "notice")
        else:
            self.agent.wake()

    @property
    def num_held(self) -> int:
        return len(self._held)

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held

    def held_blocks(self, request_id: str) -> tuple[int, ...]:
        return self._held[request_id].block_ids

    def release(self, request_id: str) -> bool:
        """Free a hold now (its reader gave up before pulling); False if nothing was held."""
        if request_id not in self._held:
            return False
        self._release(request_id, "released")
        return True

    def _on_notification(self, sender: str, message: bytes) -> None:
        notice = decode_notice(message)
        if notice is None:
            return
        if not notice.ok:
            logger.info("decode %s gave up on %s: %s", sender, notice.request_id, notice.reason)
        entry = self._held.get(notice.request_id)
        if entry is None:
            # Either early (hold() comes later) or late (already freed at the deadline): keep
            # it briefly; a late one simply expires.
            entry = self._early.setdefault(notice.request_id, _Held((), self.clock() + self.deadline_s))
            entry.senders.add(sender)
            entry.num_expected = notice.num_expected
            return
        entry.senders.add(sender)
        entry.num_expected = notice.num_expected
        if entry.is_complete:
            self._release(notice.request_id, "notice")

    def _release(self, request_id: str, why: str) -> None:
        del self._held[request_id]
        if why == "notice":
            self.num_freed_by_notice += 1
        elif why == "deadline":
            self.num_freed_by_deadline += 1
            logger.warning("freeing %s at its deadline: no completion notice", request_id)
        try:
            self.free(request_id)
        except Exception:
            logger.exception("freeing the blocks of %s failed", request_id)

    def sweep(self) -> None:
        """Free holds past their deadline and forget stale early notices (also run periodically)."""
        now = self.clock()
        for request_id in [r for r, e in self._held.items() if e.deadline <= now]:
            self._release(request_id, "deadline")
        for request_id in [r for r, e in self._early.items() if e.deadline <= now]:
            del self._early[request_id]

    async def _sweep_loop(self) -> None:
        while True:
            self.sweep()
            await asyncio.sleep(self.sweep_interval_s)
