"""``pdserve top``'s frame: what one refresh saw (``Snapshot``) and ``render``, a pure function
from it to the lines on screen.

Nothing here reads a clock, a terminal or the network, so a frame is tested from a snapshot
built by hand. A source that did not answer in time is in ``Snapshot.unanswered`` and shows as
such; its values are None and print as ``?``, never as a zero.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.cli.operate import fmt_age, fmt_ms, fmt_seconds, table
from pdserve.discovery.knobs import Knobs
from pdserve.discovery.registry import Role
from pdserve.discovery.slo import SLOTargets

UNKNOWN = "?"


@dataclass(frozen=True)
class WorkerRow:
    """One worker as the registry last had it, and what its /metrics said (None: not read)."""

    worker_id: str
    role: Role
    running: int
    waiting: int
    kv_usage: float | None  # used over total blocks; None when it reports no blocks
    draining: bool
    held_requests: int = 0
    prefix_hit_rate: float | None = None
    num_preemptions: int | None = None


@dataclass(frozen=True)
class ModelView:
    """One model: its workers, its latency against its SLO, its knobs and its migrations."""

    model: str
    workers: list[WorkerRow] = field(default_factory=list)
    slo: SLOTargets | None = None
    latency: dict[str, Any] | None = None  # ``status.merged_latency``'s: worst frontend's p50/p90 in ms
    knobs: Knobs | None = None
    knobs_source: str = "start-up"  # "stored" in etcd, or the workers' "start-up" settings
    migrations_total: int | None = None  # summed over the frontends whose /metrics answered
    migrations_recent: int | None = None  # since the previous frame; None on the first


@dataclass(frozen=True)
class Snapshot:
    """Everything one frame shows."""

    etcd: str
    time: float  # unix seconds the frame was read at
    frame: int  # 1 for the first; the header shows it, so a refresh is visible
    interval_s: float
    models: list[ModelView] = field(default_factory=list)
    num_frontends: int = 0
    unanswered: dict[str, str] = field(default_factory=dict)  # source -> why (timed out, refused...)
    etcd_age_s: float | None = None  # set when etcd did not answer: age of the registry data shown


def render(snapshot: Snapshot, width: int = 160, *, interactive: bool = False) -> list[str]:
    """The frame's lines, each cut to ``width``; ``interactive`` adds the keys' hint."""
    clock = time.strftime("%H:%M:%S", time.localtime(snapshot.time))
    head = f"pdserve top · etcd {snapshot.etcd} · {clock} · frame {snapshot.frame}"
    head += f" · every {fmt_seconds(snapshot.interval_s)}"
    if interactive:
        head += " · q to quit"
    lines = [head]
    if snapshot.etcd_age_s is not None:
        lines.append(f"registry data from {fmt_age(snapshot.etcd_age_s)} ago: etcd did not answer since")
    if not snapshot.models:
        lines += ["", "no models: no workers, SLOs or frontend stats in the registry"]
    for model in snapshot.models:
        lines += [""] + _model_lines(model, snapshot.num_frontends)
    if snapshot.unanswered:
        lines += ["", "NO ANSWER"] + [f"  {source}: {why}" for source, why in sorted(snapshot.unanswered.items())]
    return [line[:width] for line in lines]


def _model_lines(m: ModelView, num_frontends: int) -> list[str]:
    lines = [f"MODEL {m.model}"]
    for role in Role:
        workers = [w for w in m.workers if w.role is role]
        ready = sum(not w.draining for w in workers)
        bounds = ""
        if m.slo is not None:
            low, high = getattr(m.slo, f"min_{role}_replicas"), getattr(m.slo, f"max_{role}_replicas")
            bounds = f", bounds {low}..{high}"
        lines.append(f"  {role.upper()} pool: {ready} ready, {len(workers) - ready} draining{bounds}")
        if not workers:
            continue
        rows = [
            [
                w.worker_id,
                w.running,
                w.waiting,
                _percent(w.kv_usage),
                w.held_requests if role is Role.PREFILL else None,
                _percent(w.prefix_hit_rate),
                UNKNOWN if w.num_preemptions is None else w.num_preemptions,
                "draining" if w.draining else "ready",
            ]
            for w in workers
        ]
        headers = ["WORKER", "RUN", "WAIT", "KV", "HELD", "HIT", "PREEMPT", "STATE"]
        lines += table(headers, rows, "    ").splitlines()
    lines.append("")
    lines += _latency_lines(m, num_frontends)
    if m.slo is None:
        lines.append(f"  no SLO set (pdserve slo set --model {m.model} --ttft-p90 500ms --itl-p90 30ms)")
    if m.knobs is not None:
        source = "stored" if m.knobs_source == "stored" else "start-up settings"
        knobs = ", ".join(f"{k}={v}" for k, v in _builtins(m.knobs).items())
        lines.append(f"  knobs ({source}): {knobs}")
    total = UNKNOWN if m.migrations_total is None else str(m.migrations_total)
    recent = "" if m.migrations_recent is None else f", +{m.migrations_recent} since the last frame"
    lines.append(f"  migrations: {total} in all{recent}")
    return lines


def _latency_lines(m: ModelView, num_frontends: int) -> list[str]:
    latency = m.latency
    if latency is None:
        if num_frontends:
            return [f"  latency: no requests in the window of the {num_frontends} live frontend(s)"]
        return ["  latency: no frontend publishes stats"]
    rows = []
    for name in ("ttft", "itl", "e2e"):
        target = getattr(m.slo, f"{name}_p90_s") if m.slo is not None else None
        p90 = latency.get(f"{name}_p90_ms")
        check = "-" if target is None or p90 is None else ("OK" if p90 <= target * 1e3 else "BREACH")
        rows.append([name.upper(), fmt_ms(latency.get(f"{name}_p50_ms")), fmt_ms(p90), fmt_seconds(target), check])
    lines = table(["LATENCY", "P50", "P90", "SLO P90", "CHECK"], rows, "  ").splitlines()
    lines.append(
        f"  traffic: {latency['num_requests']} requests in the last {latency['window_s']:.0f}s "
        f"({latency['arrival_rate']:.2f} req/s), {latency['num_errors']} errors"
    )
    return lines


def _percent(value: float | None) -> str:
    return UNKNOWN if value is None else f"{value:.0%}"


def _builtins(knobs: Knobs) -> dict[str, Any]:
    return {name: getattr(knobs, name) for name in knobs.__struct_fields__}
