"""Live latency statistics that each frontend publishes, and the rolling window that makes them.

A frontend feeds every finished request to a :class:`RollingWindow` and, every second or so,
writes ``window.snapshot(frontend_id)`` as JSON under ``registry.frontend_key(frontend_id)``
(``/pdserve/v1/frontends/{id}``) under a lease, so a frontend that dies vanishes with it.
``pdserve status`` reads them back with :func:`list_frontend_stats` and sets them against the
model's SLO targets.

Everything here is percentiles over the last ``window_s`` seconds, never averages: a p90
target is judged against a p90. ITL counts every inter-token gap, so long requests weigh
more, as users feel it (the same rule as ``observation.Observation.itl_s``). Fields are None
when the window holds no sample for them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aetcd
import msgspec

from pdserve.control_plane.registry import ROOT

logger = logging.getLogger(__name__)

FRONTENDS_PREFIX = f"{ROOT}/frontends/"


class ModelStats(msgspec.Struct, frozen=True, kw_only=True):
    """One model's traffic and latency at one frontend over the last ``window_s`` seconds.

    Latencies are in milliseconds, token counts per request; None where the window has no
    sample (no successful request, or none with more than one output token for ITL).
    """

    window_s: float  # seconds covered: the window, or less just after the frontend started
    num_requests: int  # requests that finished (or failed) in the window
    arrival_rate: float  # requests/s that arrived in the window (and have finished since)
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p90_ms: float | None = None
    e2e_p90_ms: float | None = None
    prompt_tokens_p50: float | None = None
    prompt_tokens_p90: float | None = None
    output_tokens_p50: float | None = None
    output_tokens_p90: float | None = None
    num_errors: int = 0


class FrontendStats(msgspec.Struct, frozen=True, kw_only=True):
    """What one frontend publishes at ``registry.frontend_key(frontend_id)``."""

    frontend_id: str
    updated_at: float  # unix seconds of the snapshot
    models: dict[str, ModelStats] = {}

    def encode(self) -> bytes:
        """The JSON value stored in etcd."""
        return msgspec.json.encode(self)

    @staticmethod
    def decode(data: bytes | str) -> FrontendStats:
        """Parse a stored value; raises ValueError naming what is wrong."""
        try:
            return msgspec.json.decode(data, type=FrontendStats)
        except msgspec.DecodeError as error:
            raise ValueError(f"frontend stats do not decode: {error}") from None


async def list_frontend_stats(client: aetcd.Client, timeout_s: float = 3.0) -> list[FrontendStats]:
    """Every live frontend's latest stats, sorted by id; values that do not decode are skipped
    with a warning. Raises one of ``etcd.ETCD_ERRORS`` if etcd fails."""
    response = await asyncio.wait_for(client.get_prefix(FRONTENDS_PREFIX.encode()), timeout_s)
    stats = []
    for kv in response:
        try:
            stats.append(FrontendStats.decode(kv.value))
        except ValueError as error:
            logger.warning("skipping %s: %s", kv.key.decode(errors="replace"), error)
    return sorted(stats, key=lambda s: s.frontend_id)


@dataclass(frozen=True, slots=True)
class _Finished:
    """One finished request, as the window keeps it."""

    finished_at: float
    arrival_time: float
    ttft_s: float | None
    # The request's inter-token gaps: all of them, or for a long request evenly spaced order
    # statistics of them, each standing for ``itl_weight`` gaps.
    itl_s: tuple[float, ...]
    itl_weight: float
    e2e_s: float | None
    prompt_tokens: int
    output_tokens: int | None
    ok: bool


class RollingWindow:
    """Finished requests of the last ``window_s`` seconds, per model, summarised on demand.

    Times are unix seconds from ``clock`` (``time.time`` unless a test passes its own), and
    ``arrival_time`` must come from the same clock. A request belongs to the window by the
    time it finished (``arrival_time + e2e_s``, or the clock at ``record`` when ``e2e_s`` is
    None). Memory is bounded by requests in the window times ``max_itl_points``: a request's
    gaps beyond that are kept as ``max_itl_points`` evenly spaced order statistics, so the ITL
    percentiles of long requests are exact to 1/``max_itl_points`` of each request's spread.
    """

    def __init__(self, window_s: float = 60.0, *, max_itl_points: int = 16, clock: Callable[[], float] = time.time):
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        if max_itl_points < 1:
            raise ValueError(f"max_itl_points must be >= 1, got {max_itl_points}")
        self.window_s = window_s
        self.max_itl_points = max_itl_points
        self._clock = clock
        self._started_at = clock()
        self._requests: dict[str, deque[_Finished]] = {}

    def record(
        self,
        model: str,
        arrival_time: float,
        ttft_s: float | None,
        itl_s: Sequence[float] | float | None,
        e2e_s: float | None,
        prompt_tokens: int,
        output_tokens: int | None,
        ok: bool = True,
    ) -> None:
        """Add one finished request.

        ``itl_s`` is either every gap between consecutive tokens (the best), or their mean,
        which then stands for ``output_tokens - 1`` equal gaps, or None. A failed request
        (``ok=False``) counts in ``num_requests``, ``num_errors``, the arrival rate and the
        prompt lengths only; its latencies and output length are left out.
        """
        finished_at = arrival_time + e2e_s if e2e_s is not None else self._clock()
        gaps: tuple[float, ...] = ()
        weight = 1.0
        if ok and itl_s is not None:
            if isinstance(itl_s, (int, float)):
                num_gaps = (output_tokens or 0) - 1
                if num_gaps >= 1:
                    gaps, weight = (float(itl_s),), float(num_gaps)
            elif len(itl_s) <= self.max_itl_points:
                gaps = tuple(float(g) for g in itl_s)
            else:
                ordered, k = sorted(itl_s), self.max_itl_points
                gaps = tuple(float(ordered[int((i + 0.5) * len(ordered) / k)]) for i in range(k))
                weight = len(ordered) / k
        request = _Finished(
            finished_at=finished_at,
            arrival_time=arrival_time,
            ttft_s=ttft_s if ok else None,
            itl_s=gaps,
            itl_weight=weight,
            e2e_s=e2e_s if ok else None,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens if ok else None,
            ok=ok,
        )
        self._requests.setdefault(model, deque()).append(request)
        # Arrivals from before the window was made (a frontend feeding it late) extend what it covers.
        self._started_at = min(self._started_at, arrival_time)

    def stats(self, model: str, now: float | None = None) -> ModelStats | None:
        """The model's stats over ``(now - window_s, now]``; None when no request finished in it."""
        now = self._clock() if now is None else now
        cutoff = now - self.window_s
        queue = self._requests.get(model)
        if queue is None:
            return None
        while queue and queue[0].finished_at <= cutoff:  # recorded in about finishing order
            queue.popleft()
        window = [r for r in queue if cutoff < r.finished_at <= now]
        if not queue:
            del self._requests[model]
        if not window:
            return None
        covered = min(self.window_s, max(now - self._started_at, 1e-3))
        ok = [r for r in window if r.ok]
        ttft = _quantiles([r.ttft_s for r in ok if r.ttft_s is not None])
        itl = _quantiles([g for r in ok for g in r.itl_s], [r.itl_weight for r in ok for _ in r.itl_s])
        e2e = _quantiles([r.e2e_s for r in ok if r.e2e_s is not None])
        prompt = _quantiles([r.prompt_tokens for r in window])
        output = _quantiles([r.output_tokens for r in ok if r.output_tokens is not None])
        return ModelStats(
            window_s=covered,
            num_requests=len(window),
            arrival_rate=sum(1 for r in window if r.arrival_time > cutoff) / covered,
            ttft_p50_ms=_ms(ttft[0]),
            ttft_p90_ms=_ms(ttft[1]),
            itl_p50_ms=_ms(itl[0]),
            itl_p90_ms=_ms(itl[1]),
            e2e_p90_ms=_ms(e2e[1]),
            prompt_tokens_p50=prompt[0],
            prompt_tokens_p90=prompt[1],
            output_tokens_p50=output[0],
            output_tokens_p90=output[1],
            num_errors=len(window) - len(ok),
        )

    def snapshot(self, frontend_id: str, now: float | None = None) -> FrontendStats:
        """Stats of every model with a request in the window, ready to publish."""
        now = self._clock() if now is None else now
        models = {}
        for model in sorted(self._requests):
            stats = self.stats(model, now)
            if stats is not None:
                models[model] = stats
        return FrontendStats(frontend_id=frontend_id, updated_at=now, models=models)


def _quantiles(values: Sequence[float], weights: Sequence[float] | None = None) -> tuple[float | None, float | None]:
    """(p50, p90) by nearest rank: the smallest value whose cumulative weight reaches q of the total."""
    if not values:
        return None, None
    pairs = sorted(zip(values, weights if weights is not None else [1.0] * len(values)))
    total = sum(w for _, w in pairs)
    result = []
    for q in (0.5, 0.9):
        threshold, cumulative = q * total - 1e-9, 0.0
        for value, weight in pairs:
            cumulative += weight
            if cumulative >= threshold:
                break
        result.append(float(value))
    return result[0], result[1]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or not math.isfinite(seconds) else seconds * 1e3
