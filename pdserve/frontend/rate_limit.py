"""Per-key request rates on the public APIs: a token bucket for each API key.

Each key may start ``rate`` requests a second on average and ``burst`` at once; a request past
that is refused (HTTP 429 with ``Retry-After``, gRPC RESOURCE_EXHAUSTED) with how long to wait.
Without API keys every client shares one bucket. Buckets live in memory, one per configured
key, named by ``ApiKeys.identify`` (the key's position, never the key), so spelling the same key
differently (``bearer KEY``, extra spaces) draws from the same bucket.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    def __init__(self, rate: float, burst: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate must be > 0 requests/s, got {rate}")
        self.rate = rate
        self.burst = burst if burst is not None else max(1, math.ceil(rate))
        if self.burst < 1:
            raise ValueError(f"burst must be >= 1, got {self.burst}")
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def acquire(self, key: str) -> float:
        """Take one request from ``key``'s bucket: 0 when allowed, else the seconds until one is."""
        now = self._clock()
        bucket = self._buckets.setdefault(key, _Bucket(float(self.burst), now))
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.rate)
        bucket.updated = now
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return 0.0
        return (1 - bucket.tokens) / self.rate

    @staticmethod
    def problem(wait_s: float) -> str:
        return f"rate limit of this API key reached (rate_limit_rps); retry in {wait_s:.2f}s"
