"""Live latency statistics that each frontend publishes, and the rolling window that makes them.

A frontend tells its :class:`RollingWindow` of every request when it arrives and again when
it finishes, and every second writes ``window.snapshot(frontend_id)`` as JSON under
``registry.frontend_key(frontend_id)`` (``/pdserve/v1/frontends/{id}``) under a lease, so a
frontend that dies vanishes with it. ``pdserve status`` reads them back with
:func:`list_frontend_stats` and sets them against the model's SLO targets; the planner
turns them into its ``Observation``s.

Everything here is percentiles over the last ``window_s`` seconds, never averages: a p90
target is judged against a p90. ITL is per request: its mean gap between tokens, the same
rule as ``observation.Observation.itl_s``, so what ``pdserve status`` calls a breach is what
the planner acts on. Fields are None when the window holds no sample for them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import aetcd
import msgspec

from pdserve.discovery.registry import ROOT
from pdserve.observability.summary import Summary

logger = logging.getLogger(__name__)

FRONTENDS_PREFIX = f"{ROOT}/frontends/"

T = TypeVar("T")


class ModelStats(msgspec.Struct, frozen=True, kw_only=True):
    """One model's traffic and latency at one frontend over the last ``window_s`` seconds.

    Latencies are in milliseconds, token counts per request; None where the window has no
    sample (no successful request, or none with more than one output token for ITL).
    """

    window_s: float  # seconds covered: the window, or less just after the frontend started
    num_requests: int  # requests that finished (or failed) in the window
    arrival_rate: float  # requests/s that arrived in the window, finished or not
    # Arrivals in each whole second of the window, oldest first; the last is the second that
    # ends at the snapshot (``FrontendStats.updated_at``), which may still be filling.
    arrivals_per_s: list[int] = []
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p90_ms: float | None = None
    e2e_p90_ms: float | None = None
    prompt_tokens_mean: float | None = None
    prompt_tokens_p50: float | None = None
    prompt_tokens_p90: float | None = None
    output_tokens_mean: float | None = None
    output_tokens_p50: float | None = None
    output_tokens_p90: float | None = None
    num_errors: int = 0


class FrontendStats(msgspec.Struct, frozen=True, kw_only=True):
    """What one frontend publishes at ``registry.frontend_key(frontend_id)``."""

    frontend_id: str
    updated_at: float  # unix seconds of the snapshot
    models: dict[str, ModelStats] = {}
    # The router's start-up local-prefill threshold (--local-prefill-threshold); None unless it
    # routes conditionally. Live knobs override it; the planner starts from it.
    local_prefill_tokens: int | None = None
    # host:port of its Prometheus /metrics (``pdserve top`` reads the migrations there); None: not served.
    metrics_endpoint: str | None = None

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
    async with asyncio.timeout(timeout_s):
        response = await client.get_prefix(FRONTENDS_PREFIX.encode())
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
    ttft_s: float | None
    itl_s: float | None  # the request's mean gap between tokens
    e2e_s: float | None
    prompt_tokens: int
    output_tokens: int | None
    ok: bool


class RollingWindow:
    """Requests of the last ``window_s`` seconds, per model, summarised on demand.

    Times are unix seconds from ``clock`` (``time.time`` unless a test passes its own), and
    the times passed in must come from the same clock. ``arrived`` counts a request when it
    comes in (a burst shows at once, not when its requests finish); ``record`` adds it when
    it finishes. Latencies and lengths cover requests that finished in the window. Memory is
    bounded by the requests of one window.
    """

    def __init__(self, window_s: float = 10.0, *, clock: Callable[[], float] = time.time):
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self._clock = clock
        self._started_at = clock()
        self._requests: dict[str, deque[_Finished]] = {}
        self._arrivals: dict[str, deque[float]] = {}

    def arrived(self, model: str, at: float | None = None) -> None:
        """Count one request arriving for ``model`` (now, unless ``at`` says when)."""
        at = self._clock() if at is None else at
        self._arrivals.setdefault(model, deque()).append(at)
        # Arrivals from before the window was made (a frontend feeding it late) extend what it covers.
        self._started_at = min(self._started_at, at)

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
        """Add one finished request (its arrival is counted by ``arrived``, not here).

        ``itl_s`` is the request's mean gap between tokens, or every gap (their mean is
        taken), or None; a request with fewer than two output tokens has no gap. A failed
        request (``ok=False``) counts in ``num_requests``, ``num_errors`` and the prompt
        lengths only; its latencies and output length are left out.
        """
        finished_at = arrival_time + e2e_s if e2e_s is not None else self._clock()
        mean_gap: float | None = None
        if ok and itl_s is not None and (output_tokens or 0) >= 2:
            gaps = [float(itl_s)] if isinstance(itl_s, (int, float)) else [float(g) for g in itl_s]
            mean_gap = sum(gaps) / len(gaps) if gaps else None
        request = _Finished(
            finished_at=finished_at,
            ttft_s=ttft_s if ok else None,
            itl_s=mean_gap,
            e2e_s=e2e_s if ok else None,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens if ok else None,
            ok=ok,
        )
        self._requests.setdefault(model, deque()).append(request)
        self._started_at = min(self._started_at, arrival_time)

    def stats(self, model: str, now: float | None = None) -> ModelStats | None:
        """The model's stats over ``(now - window_s, now]``; None when nothing arrived or finished in it."""
        now = self._clock() if now is None else now
        cutoff = now - self.window_s
        window = self._recent(self._requests, model, cutoff, lambda r: r.finished_at)
        arrivals = self._recent(self._arrivals, model, cutoff, lambda t: t)
        window = [r for r in window if r.finished_at <= now]
        arrivals = [t for t in arrivals if t <= now]
        if not window and not arrivals:
            return None
        covered = min(self.window_s, max(now - self._started_at, 1e-3))
        ok = [r for r in window if r.ok]
        ttft = _quantiles([r.ttft_s for r in ok if r.ttft_s is not None])
        itl = _quantiles([r.itl_s for r in ok if r.itl_s is not None])
        e2e = _quantiles([r.e2e_s for r in ok if r.e2e_s is not None])
        prompts = [r.prompt_tokens for r in window]
        outputs = [r.output_tokens for r in ok if r.output_tokens is not None]
        prompt, output = _quantiles(prompts), _quantiles(outputs)
        seconds = max(1, math.ceil(covered))
        per_second = [0] * seconds
        last = math.floor(now)  # the second [last, last + 1) holds now
        for t in arrivals:
            index = seconds - 1 - (last - math.floor(t))
            if 0 <= index < seconds:
                per_second[index] += 1
        return ModelStats(
            window_s=covered,
            num_requests=len(window),
            arrival_rate=len(arrivals) / covered,
            arrivals_per_s=per_second,
            ttft_p50_ms=_ms(ttft[0]),
            ttft_p90_ms=_ms(ttft[1]),
            itl_p50_ms=_ms(itl[0]),
            itl_p90_ms=_ms(itl[1]),
            e2e_p90_ms=_ms(e2e[1]),
            prompt_tokens_mean=sum(prompts) / len(prompts) if prompts else None,
            prompt_tokens_p50=prompt[0],
            prompt_tokens_p90=prompt[1],
            output_tokens_mean=sum(outputs) / len(outputs) if outputs else None,
            output_tokens_p50=output[0],
            output_tokens_p90=output[1],
            num_errors=len(window) - len(ok),
        )

    def snapshot(self, frontend_id: str, now: float | None = None) -> FrontendStats:
        """Stats of every model with a request in the window, ready to publish."""
        now = self._clock() if now is None else now
        models = {}
        for model in sorted(set(self._requests) | set(self._arrivals)):
            stats = self.stats(model, now)
            if stats is not None:
                models[model] = stats
        return FrontendStats(frontend_id=frontend_id, updated_at=now, models=models)

    @staticmethod
    def _recent(by_model: dict[str, deque[T]], model: str, cutoff: float, when: Callable[[T], float]) -> list[T]:
        """The model's items after ``cutoff``, dropping older ones (they come in about time order)."""
        queue = by_model.get(model)
        if queue is None:
            return []
        while queue and when(queue[0]) <= cutoff:
            queue.popleft()
        if not queue:
            del by_model[model]
            return []
        return [item for item in queue if when(item) > cutoff]


def _quantiles(values: Sequence[float]) -> tuple[float | None, float | None]:
    """(p50, p90) by nearest rank."""
    summary = Summary.of(values)
    return (None, None) if summary is None else (summary.p50, summary.p90)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or not math.isfinite(seconds) else seconds * 1e3
