"""Blocks a finished PRODUCER request keeps for a peer, each pin with its deadline.

A prefill request stops after its first token; its blocks stay allocated until the decode
side has read them. The scheduler owns one ``BlockPins`` (vLLM v1's scheduler keeps such
requests in ``_reqs_need_send`` with an expiry the same way). A pin is freed — through
``free``, normally ``KVCacheManager.free`` — exactly once, by whichever comes first:

- ``sent``: the transfer layer reports that every decode rank is done with the blocks
  (it pulled them, needed none, or gave up);
- ``expire``: the deadline passed (a decode worker that died or never pulled). The scheduler
  runs it every step, and the engine loop steps by ``next_deadline`` even when idle;
- ``release``: nobody will pull (the frontend's hint, an abort, the engine loop stopping).

A "sent" may come before its pin. The pins, not the transfer layer, keep it: it is honoured
by ``pin`` if that comes within ``early_sent_ttl_s``, and otherwise forgotten — which is also
what becomes of a "sent" that comes after the pin's deadline freed it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class BlockPins:
    """Pinned requests by id, with their deadlines in ``clock`` time (``time.monotonic``)."""

    def __init__(
        self,
        free: Callable[[str], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        early_sent_ttl_s: float = 10.0,
    ) -> None:
        self.free = free
        self.clock = clock
        self.early_sent_ttl_s = early_sent_ttl_s
        self._deadlines: dict[str, float] = {}
        self._early_sent: dict[str, float] = {}  # request id -> when the report is forgotten
        self.num_freed_by_sent = 0
        self.num_freed_by_deadline = 0
        self.num_released = 0

    def __len__(self) -> int:
        return len(self._deadlines)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._deadlines

    def pin(self, request_id: str, pin_s: float) -> None:
        """Keep the request's blocks for at most ``pin_s`` seconds (freed now if already sent)."""
        if request_id in self._deadlines:
            raise ValueError(f"request {request_id!r} is already pinned")
        self._deadlines[request_id] = self.clock() + pin_s
        if self._early_sent.pop(request_id, None) is not None:
            self._free(request_id, "sent")

    def sent(self, request_id: str) -> bool:
        """The far side is done with the blocks: free them; False (kept for ``pin``) if not pinned."""
        if request_id in self._deadlines:
            self._free(request_id, "sent")
            return True
        self._early_sent[request_id] = self.clock() + self.early_sent_ttl_s
        return False

    def release(self, request_id: str) -> bool:
        """Free the pin now if there is one; False (and nothing changes) otherwise."""
        if request_id not in self._deadlines:
            return False
        self._free(request_id, "released")
        return True

    def release_all(self) -> None:
        """Free every pin (the pool outlives none) and forget early reports."""
        for request_id in list(self._deadlines):
            self._free(request_id, "released")
        self._early_sent.clear()

    def expire(self) -> None:
        """Free the pins past their deadline and forget stale early reports."""
        now = self.clock()
        for request_id in [r for r, deadline in self._deadlines.items() if deadline <= now]:
            self._free(request_id, "deadline")
        for request_id in [r for r, forget_at in self._early_sent.items() if forget_at <= now]:
            del self._early_sent[request_id]

    @property
    def next_deadline(self) -> float | None:
        """The earliest pin's deadline (None: nothing pinned); stale early reports just wait."""
        return min(self._deadlines.values(), default=None)

    def _free(self, request_id: str, why: str) -> None:
        del self._deadlines[request_id]
        if why == "sent":
            self.num_freed_by_sent += 1
        elif why == "deadline":
            self.num_freed_by_deadline += 1
            logger.warning("freeing the pinned blocks of %s at their deadline: not reported sent", request_id)
        else:
            self.num_released += 1
        self.free(request_id)
