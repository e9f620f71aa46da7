"""Build the planner's ``Observation`` of one model from what etcd holds: frontend stats and worker loads.

The frontends publish percentiles over a window as long as the planner's interval
(``frontend_stats``), and the workers publish their load every second (``registry``); one
read of both at the end of an interval is the interval's observation.

With several frontends the merge is exact for counts and arrivals and conservative for
tails: a p90 is the worst frontend's, a p50 and a mean are weighted by requests. With no
frontend snapshot from within the interval the observation says the traffic is unknown
(``traffic_observed`` False) rather than zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pdserve.discovery.knobs import Knobs
from pdserve.discovery.registry import Role, WorkerEntry
from pdserve.observability.frontend_stats import FrontendStats, ModelStats
from pdserve.observability.summary import Summary
from pdserve.planner.observation import Observation


def observe(
    model: str,
    frontends: Sequence[FrontendStats],
    workers: Sequence[WorkerEntry],
    knobs: Knobs,
    *,
    now: float,
    interval_s: float,
) -> Observation:
    """The model's observation for the interval ending at ``now`` (unix seconds); arrivals are
    counted over the ``interval_s`` whole seconds that end two seconds before ``now``."""
    stats = [(f.updated_at, f.models[model]) for f in frontends if model in f.models]
    seconds = max(1, round(interval_s))
    arrivals = [0] * seconds
    # The newest whole second every frontend has finished counting: a snapshot is up to one
    # publish period (1 s) old, and the second it was taken in was still filling.
    last = math.floor(now) - 2
    for updated_at, s in stats:
        end = math.floor(updated_at)
        for i, count in enumerate(reversed(s.arrivals_per_s)):
            index = seconds - 1 - (last - (end - i))
            if 0 <= index < seconds:
                arrivals[index] += count
    models = [s for _, s in stats]
    ready = [w for w in workers if w.model == model and not w.draining]
    prefill = [w for w in ready if w.role is Role.PREFILL]
    decode = [w for w in ready if w.role is Role.DECODE]
    return Observation(
        model=model,
        time=now,
        interval_s=float(seconds),
        arrivals_per_s=arrivals,
        prompt_tokens=_merge(models, "prompt_tokens_p50", "prompt_tokens_p90", mean="prompt_tokens_mean"),
        output_tokens=_merge(models, "output_tokens_p50", "output_tokens_p90", mean="output_tokens_mean"),
        ttft_s=_merge(models, "ttft_p50_ms", "ttft_p90_ms", scale=1e-3),
        itl_s=_merge(models, "itl_p50_ms", "itl_p90_ms", scale=1e-3),
        e2e_s=_merge(models, "e2e_p90_ms", "e2e_p90_ms", scale=1e-3),  # only a p90 is published
        num_prefill_ready=len(prefill),
        num_decode_ready=len(decode),
        prefill_waiting=sum(w.load.waiting for w in prefill),
        decode_running=sum(w.load.running for w in decode) / len(decode) if decode else 0.0,
        decode_kv_usage=sum(w.load.kv_usage for w in decode) / len(decode) if decode else 0.0,
        knobs=knobs,
        # A frontend's snapshot older than the interval covers none of it (one that stopped
        # publishing, or no frontend at all): the traffic is then unknown, not zero.
        traffic_observed=any(f.updated_at >= now - seconds for f in frontends),
    )


def _merge(
    stats: list[ModelStats], p50_field: str, p90_field: str, *, scale: float = 1.0, mean: str | None = None
) -> Summary | None:
    """One Summary from the frontends' p50/p90 (and mean) fields, each value times ``scale``."""
    rows = []
    for s in stats:
        p90 = getattr(s, p90_field)
        if p90 is None:
            continue
        p50 = getattr(s, p50_field)
        p50 = p90 if p50 is None else p50
        average = getattr(s, mean) if mean is not None else None
        average = p50 if average is None else average
        rows.append((max(s.num_requests - s.num_errors, 1), p50 * scale, p90 * scale, average * scale))
    if not rows:
        return None
    total = sum(n for n, *_ in rows)
    worst = max(p90 for _, _, p90, _ in rows)
    return Summary(
        count=total,
        mean=sum(n * m for n, _, _, m in rows) / total,
        p50=sum(n * p50 for n, p50, _, _ in rows) / total,
        p90=worst,
        max=worst,
    )
