"""Per-request transfer statistics, for metrics and the per-request latency breakdown."""

from __future__ import annotations

import msgspec


class TransferStats(msgspec.Struct, kw_only=True):
    """What one pull of one request moved (on one decode rank).

    ``num_descriptors`` counts NIXL descriptors after coalescing contiguous runs;
    ``setup_seconds`` is the time from the pull call until every transfer request was made
    and ready to post (posting itself may move data synchronously on some transports);
    ``seconds`` the whole pull, completion notices included.
    """

    request_id: str
    num_blocks: int
    num_bytes: int
    num_descriptors: int
    num_transfers: int
    setup_seconds: float
    seconds: float

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9) per second over the whole pull; 0 when nothing moved."""
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 and self.num_bytes else 0.0
