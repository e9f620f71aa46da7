"""``pdserve status``: one screen per model — pools, load, live latency against the SLO, and
the planner's last decision with its reasons."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any
from urllib.parse import unquote

import aetcd
import msgspec

from pdserve.cli.operate import (
    ETCD_TIMEOUT_S,
    EXIT_STATUS,
    add_etcd_arg,
    fmt_age,
    fmt_ms,
    fmt_seconds,
    print_json,
    read_workers,
    run_with_etcd,
    table,
    unreachable,
)
from pdserve.cli.common import etcd_auth, positive_duration
from pdserve.discovery.etcd import ETCD_ERRORS, EtcdConnection, RegistryUnavailable
from pdserve.discovery.knobs import list_knobs
from pdserve.discovery.registry import ROOT, Role, WorkerEntry
from pdserve.discovery.slo import SLOTargets
from pdserve.discovery.slo_store import list_slos
from pdserve.observability.frontend_stats import ModelStats, list_frontend_stats
from pdserve.planner.deployed_knobs import deployed_knobs

PLANNER_PREFIX = f"{ROOT}/planner/"

DESCRIPTION = """One screen per model: its prefill and decode pools (workers ready and draining,
their load, and the replicas the planner wants), the live p50/p90 TTFT and ITL the frontends
measure over their rolling window set against the SLO (OK, or BREACH when the p90 is over its
target), and the planner's last decision with its reasons. With several frontends, each
percentile shown is the worst frontend's."""

EXAMPLES = f"""examples:
  pdserve status --etcd http://127.0.0.1:2379
  pdserve status --model meta-llama/Llama-3.1-8B --watch --interval 5s
  pdserve status --json | jq '.models[] | {{model, checks}}'
  pdserve status --watch --json           # one JSON document per line, every --interval

--json prints {{"etcd", "time", "num_frontends", "models": [...]}}; each model has "slo", "pools" (prefill and
decode: ready, draining, workers, running, waiting, held_requests, queued_prefill_tokens,
kv_usage), "latency" (the frontends' stats merged, with "by_frontend"), "checks" ("OK",
"BREACH" or null per target), "planner" (the decision as the planner published it) and
"knobs" (the live knobs in force, with "source": "stored" or "start-up").
With --watch, etcd going away later is shown on screen and retried (only a first connection
that fails ends the command).

{EXIT_STATUS}
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    status = commands.add_parser(
        "status",
        help="per model: pools, load, live latency vs SLO, planner decision",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_etcd_arg(status)
    status.add_argument("--model", help="only this model")
    status.add_argument("--watch", action="store_true", help="redraw every --interval until Ctrl-C")
    status.add_argument(
        "--interval",
        type=positive_duration,
        default=2.0,
        metavar="DURATION",
        help="with --watch: time between redraws, e.g. 5s (default: 2s)",
    )
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.set_defaults(func=run_status)


def run_status(args: argparse.Namespace) -> int:
    async def once(client: aetcd.Client) -> int:
        status = await collect(client, args.etcd, args.model)
        if args.json:
            print_json(status)
        else:
            print(render(status))
        return 0

    return run_with_etcd(args, (lambda client: watch(client, args)) if args.watch else once)


async def watch(client: aetcd.Client, args: argparse.Namespace) -> int:
    """Redraw until interrupted; while etcd is away, say so and keep trying."""
    reconnect = EtcdConnection(args.etcd, ETCD_TIMEOUT_S, etcd_auth(args))
    first: aetcd.Client | None = client  # run_with_etcd's (it closes it), until a read fails
    is_tty = sys.stdout.isatty()
    try:
        while True:
            try:
                if first is not None:
                    status = await collect(first, args.etcd, args.model)
                else:
                    async with reconnect.use() as current:
                        status = await collect(current, args.etcd, args.model)
                text = None if args.json else render(status)
            except ETCD_ERRORS + (RegistryUnavailable,) as error:
                status, text = None, f"{unreachable(args.etcd, error)}; retrying every {fmt_seconds(args.interval)}"
                first = None
            if args.json:
                print_json(status or {"etcd": args.etcd, "time": time.time(), "error": text}, compact=True)
            else:
                assert text is not None  # rendered, or the error, when not --json
                header = (
                    f"pdserve status · etcd {args.etcd} · {time.strftime('%H:%M:%S')} · "
                    f"every {fmt_seconds(args.interval)} (Ctrl-C to stop)"
                )
                print(("\x1b[H\x1b[2J" if is_tty else "") + header + "\n\n" + text + ("" if is_tty else "\n"))
            sys.stdout.flush()
            await asyncio.sleep(args.interval)
    finally:
        await reconnect.close()


async def read_decisions(client: aetcd.Client) -> dict[str, dict[str, Any]]:
    """The planner's last published decision per model, as raw JSON objects (any fields)."""
    async with asyncio.timeout(ETCD_TIMEOUT_S):
        response = await client.get_prefix(PLANNER_PREFIX.encode())
    decisions = {}
    for kv in response:
        try:
            value = msgspec.json.decode(kv.value)
        except msgspec.DecodeError:
            continue
        if isinstance(value, dict):
            decisions[unquote(kv.key.decode()[len(PLANNER_PREFIX) :])] = value
    return decisions


async def collect(client: aetcd.Client, etcd: str, model: str | None = None) -> dict[str, Any]:
    """Everything ``status`` shows, as the JSON it prints; etcd is read once, concurrently."""
    workers, slos, decisions, frontends, stored_knobs = await asyncio.gather(
        read_workers(client),
        list_slos(client, ETCD_TIMEOUT_S),
        read_decisions(client),
        list_frontend_stats(client, ETCD_TIMEOUT_S),
        list_knobs(client, ETCD_TIMEOUT_S),
    )
    now = time.time()
    slo_by_model = {t.model: t for t in slos}
    stats_by_model: dict[str, dict[str, tuple[float, ModelStats]]] = {}
    for frontend in frontends:
        for name, stats in frontend.models.items():
            stats_by_model.setdefault(name, {})[frontend.frontend_id] = (frontend.updated_at, stats)
    names = {e.model for e, _ in workers} | set(slo_by_model) | set(decisions) | set(stats_by_model)
    models = []
    for name in sorted(n for n in names if model in (None, n)):
        entries = [e for e, _ in workers if e.model == name]
        slo = slo_by_model.get(name)
        latency = merged_latency(stats_by_model.get(name, {}), now)
        knobs = stored_knobs.get(name)
        source = "stored" if knobs is not None else "start-up"
        if knobs is None:
            knobs = deployed_knobs(name, entries, frontends)
        models.append(
            {
                "model": name,
                "slo": msgspec.to_builtins(slo) if slo is not None else None,
                "pools": {role: pool_status([e for e in entries if e.role == role]) for role in Role},
                "latency": latency,
                "checks": checks(slo, latency),
                "planner": decisions.get(name),
                "knobs": {"source": source, **msgspec.to_builtins(knobs)},
            }
        )
    return {"etcd": etcd, "time": now, "num_frontends": len(frontends), "models": models}


def pool_status(entries: list[WorkerEntry]) -> dict[str, Any]:
    """One pool's replicas and summed load; ``kv_usage`` over the pool's blocks, None if unknown."""
    loads = [e.load for e in entries]
    total_blocks = sum(load.kv_blocks_total for load in loads)
    return {
        "ready": sum(not e.draining for e in entries),
        "draining": sum(e.draining for e in entries),
        "workers": [e.worker_id for e in entries],
        "running": sum(load.running for load in loads),
        "waiting": sum(load.waiting for load in loads),
        "held_requests": sum(load.held_requests for load in loads),
        "queued_prefill_tokens": sum(load.queued_prefill_tokens for load in loads),
        "kv_usage": sum(load.kv_blocks_used for load in loads) / total_blocks if total_blocks else None,
    }


def merged_latency(by_frontend: dict[str, tuple[float, ModelStats]], now: float) -> dict[str, Any] | None:
    """The frontends' stats for one model: counts and rates summed, each percentile the worst."""
    if not by_frontend:
        return None
    stats = [s for _, s in by_frontend.values()]

    def worst(field: str) -> float | None:
        return max((v for s in stats if (v := getattr(s, field)) is not None), default=None)

    merged: dict[str, Any] = {
        "num_frontends": len(stats),
        "window_s": max(s.window_s for s in stats),
        "num_requests": sum(s.num_requests for s in stats),
        "arrival_rate": sum(s.arrival_rate for s in stats),
        "num_errors": sum(s.num_errors for s in stats),
        "oldest_update_age_s": now - min(updated for updated, _ in by_frontend.values()),
    }
    for field in ModelStats.__struct_fields__:
        if field.endswith(("_ms", "_p50", "_p90")):
            merged[field] = worst(field)
    merged["by_frontend"] = {fid: msgspec.to_builtins(s) for fid, (_, s) in sorted(by_frontend.items())}
    return merged


def checks(slo: SLOTargets | None, latency: dict[str, Any] | None) -> dict[str, str | None]:
    """Per target: "OK" when the live p90 is within it, "BREACH" when over, None when unknown."""

    def verdict(observed_ms: float | None, target_s: float | None) -> str | None:
        if observed_ms is None or target_s is None:
            return None
        return "OK" if observed_ms <= target_s * 1e3 else "BREACH"

    def observed(field: str) -> float | None:
        return latency.get(field) if latency else None

    return {
        "ttft_p90": verdict(observed("ttft_p90_ms"), slo.ttft_p90_s if slo else None),
        "itl_p90": verdict(observed("itl_p90_ms"), slo.itl_p90_s if slo else None),
        "e2e_p90": verdict(observed("e2e_p90_ms"), slo.e2e_p90_s if slo else None),
    }


def render(status: dict[str, Any]) -> str:
    """The human-readable screen for ``collect``'s result."""
    if not status["models"]:
        return f"no models: no workers, SLOs, planner decisions or frontend stats in etcd at {status['etcd']}"
    return "\n\n".join(_render_model(m, status["time"], status["num_frontends"]) for m in status["models"])


def _render_model(m: dict[str, Any], now: float, num_frontends: int) -> str:
    slo, latency, planner, pools = m["slo"], m["latency"], m["planner"] or {}, m["pools"]
    lines = [f"MODEL {m['model']}"]
    if slo is None:
        lines.append(f"  no SLO set (pdserve slo set --model {m['model']} --ttft-p90 500ms --itl-p90 30ms)")
    rows = []
    for role in Role:
        p = pools[role]
        kv = f"{p['kv_usage']:.0%}" if p["kv_usage"] is not None else None
        bounds = f"{slo[f'min_{role}_replicas']}..{slo[f'max_{role}_replicas']}" if slo else None
        rows.append(
            [
                role,
                p["ready"],
                p["draining"],
                p["running"],
                p["waiting"],
                p["held_requests"] if role is Role.PREFILL else None,
                p["queued_prefill_tokens"] if role is Role.PREFILL else None,
                kv,
                planner.get(f"{role}_replicas"),
                bounds,
            ]
        )
    headers = ["POOL", "READY", "DRAINING", "RUNNING", "WAITING", "HELD", "QUEUED_TOK", "KV", "PLANNED", "BOUNDS"]
    lines.append(table(headers, rows, "  "))
    lines.append("")
    if latency is None and num_frontends:
        lines.append(
            f"  latency: no requests for this model in the current window of the {num_frontends} "
            f"live frontend{'s' if num_frontends > 1 else ''}"
        )
    elif latency is None:
        lines.append("  latency: no frontend is running (none has published stats)")
    else:
        target = {key: slo.get(f"{key}_p90_s") if slo else None for key in ("ttft", "itl", "e2e")}
        rows = [
            [
                name.upper(),
                fmt_ms(latency.get(f"{name}_p50_ms")),
                fmt_ms(latency.get(f"{name}_p90_ms")),
                fmt_seconds(target[name]),
                m["checks"][f"{name}_p90"] or "-",
            ]
            for name in ("ttft", "itl", "e2e")
        ]
        lines.append(table(["LATENCY", "P50", "P90", "TARGET", "CHECK"], rows, "  "))
        frontends = latency["num_frontends"]
        worst = ", percentiles of the worst" if frontends > 1 else ""
        lines.append(
            f"  traffic: {latency['num_requests']} requests in the last {latency['window_s']:.0f}s "
            f"({latency['arrival_rate']:.2f} req/s), {latency['num_errors']} errors; "
            f"{frontends} frontend{'s' if frontends > 1 else ''}{worst}, "
            f"updated {fmt_age(latency['oldest_update_age_s'])} ago"
        )
    knobs = dict(m["knobs"])
    source = knobs.pop("source")
    lines.append(
        f"  knobs in force ({'stored' if source == 'stored' else 'start-up settings'}): "
        + ", ".join(f"{k}={v}" for k, v in knobs.items())
    )
    lines.append("")
    lines.extend(_render_planner(m["planner"], now))
    return "\n".join(lines)


def _render_planner(decision: dict[str, Any] | None, now: float) -> list[str]:
    if decision is None:
        return ["  planner: no decision published"]
    when = decision.get("time")
    # Decision.time is the observation's clock; it reads as an age only when it is unix time.
    if isinstance(when, (int, float)) and 1e9 < when <= now + 60:
        head = f"  planner ({fmt_age(now - when)} ago)"
    else:
        head = f"  planner (time {when})"
    parts = [f"{role} {decision[f'{role}_replicas']}" for role in Role if f"{role}_replicas" in decision]
    if isinstance(decision.get("rate"), (int, float)):
        peak = decision.get("peak_rate")
        parts.append(
            f"rate {decision['rate']:.2f} req/s" + (f" (peak {peak:.2f})" if isinstance(peak, (int, float)) else "")
        )
    for name in ("ttft", "itl"):
        if f"predicted_{name}_p90_s" in decision:
            predicted = decision[f"predicted_{name}_p90_s"]
            parts.append(f"predicted {name.upper()} p90 {fmt_seconds(predicted) if predicted else 'unbounded'}")
    lines = [f"{head}: {', '.join(parts) or 'no replica counts'}"]
    if isinstance(decision.get("knobs"), dict):
        lines.append("    knobs: " + ", ".join(f"{k}={v}" for k, v in decision["knobs"].items()))
    reasons = decision.get("reasons")
    if isinstance(reasons, list) and reasons:
        lines.append("    why:")
        lines.extend(f"      - {reason}" for reason in reasons)
    return lines
