"""Prefill side: turn decode ranks' completion notices into one "sent" report per request.

The transfer layer only reports, like vLLM's connector worker side reports
``finished_sending``: ``SentReporter`` listens for ``CompletionNotice``s on the agent and
calls ``on_sent(request_id)`` once every decode rank that reads from this prefill rank has
sent its notice (``num_expected`` of them, carried in each). It owns nothing else: the
blocks, their pins and deadlines belong to the engine, and so does a "sent" that comes before
its pin (``pdserve.engine.pins``). The only state here is the tally of a request some ranks
but not all have notified, forgotten after ``forget_after_s`` (a decode rank that died).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pdserve.kvtransfer.agent import KVAgent
from pdserve.kvtransfer.messages import decode_notice

logger = logging.getLogger(__name__)


class _Tally:
    __slots__ = ("senders", "forget_at")

    def __init__(self, forget_at: float) -> None:
        self.senders: set[str] = set()
        self.forget_at = forget_at


class SentReporter:
    """Reports requests whose decode ranks are all done with this rank's blocks.

    ``on_sent(request_id)`` runs on the agent's event loop and must not block. Notices are
    fetched only while ``is_wanted()`` (some pin waits for one; NIXL queues them meanwhile),
    so an idle worker costs no CPU: call ``wake`` when it turns true. ``start`` and ``close``
    from that event loop.
    """

    def __init__(
        self,
        agent: KVAgent,
        on_sent: Callable[[str], None],
        *,
        is_wanted: Callable[[], bool],
        forget_after_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agent = agent
        self.on_sent = on_sent
        self.is_wanted = is_wanted
        self.forget_after_s = forget_after_s
        self.clock = clock
        self._tallies: dict[str, _Tally] = {}
        self.num_reported = 0

    def start(self) -> None:
        """Listen for notices."""
        self.agent.add_notification_handler(self._on_notification, self.is_wanted)

    def close(self) -> None:
        """Stop listening."""
        self.agent.remove_notification_handler(self._on_notification)
        self._tallies.clear()

    def wake(self) -> None:
        """``is_wanted`` may have turned true: fetch notices again."""
        self.agent.wake()

    def _on_notification(self, sender: str, message: bytes) -> None:
        notice = decode_notice(message)
        if notice is None:
            return
        if not notice.ok:
            logger.info("decode %s gave up on %s: %s", sender, notice.request_id, notice.reason)
        now = self.clock()
        for request_id in [r for r, t in self._tallies.items() if t.forget_at <= now]:
            del self._tallies[request_id]
        tally = self._tallies.setdefault(notice.request_id, _Tally(now + self.forget_after_s))
        tally.senders.add(sender)
        if len(tally.senders) < notice.num_expected:
            return
        del self._tallies[notice.request_id]
        self.num_reported += 1
        self.on_sent(notice.request_id)
