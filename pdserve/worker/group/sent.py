"""A prefill group's "sent": a request's pin is freed once every rank's notices are in.

Each prefill rank holds its heads of the pinned blocks and gets its own completion notices
(``SentReporter`` tallies them per rank: rank 0's here, the others' in their ``RankService``,
which forwards a ``RankSent``). The blocks belong to rank 0's engine, so rank 0 frees the pin
(``on_sent``) only when every rank has reported the request; the engine's pin deadline covers
a rank that never does. A partial tally is forgotten after ``forget_after_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class GroupSent:
    def __init__(
        self,
        size: int,
        on_sent: Callable[[str], None],
        *,
        forget_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.size = size
        self.on_sent = on_sent
        self.forget_after_s = forget_after_s
        self.clock = clock
        self._tallies: dict[str, tuple[set[int], float]] = {}  # request id -> (ranks reported, forget at)

    def rank_sent(self, rank: int, request_id: str) -> None:
        """Rank ``rank`` has every notice it expects for ``request_id``."""
        now = self.clock()
        for stale in [r for r, (_, forget_at) in self._tallies.items() if forget_at <= now]:
            del self._tallies[stale]
        ranks, _ = self._tallies.setdefault(request_id, (set(), now + self.forget_after_s))
        ranks.add(rank)
        if len(ranks) == self.size:
            del self._tallies[request_id]
            self.on_sent(request_id)
