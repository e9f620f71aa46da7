"""``pdserve up``: a whole disaggregated deployment on this machine, in one command."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.cli.common import add_engine_args, engine_argv
from pdserve.cli.operate import duration
from pdserve.cli.planner import add_planner_args, load_planner
from pdserve.cli.serve import add_frontend_args
from pdserve.discovery.registry import Role

if TYPE_CHECKING:
    from pdserve.discovery.slo import SLOTargets
    from pdserve.launch.local_cluster import LocalCluster
    from pdserve.planner.planner import PlannerConfig
    from pdserve.planner.profile import EngineProfile

DESCRIPTION = """Start the frontend, N prefill workers and M decode workers as separate
processes on this machine (each with its own engine and NIXL agent), print where the API
listens, and serve until Ctrl-C or SIGTERM, which stops every process cleanly (workers drain).

Registry: with --etcd, that etcd. Without it, an embedded registry runs inside this process: a
minimal, in-memory etcd v3 server (KV and leases only, no persistence) that needs nothing
installed; it is for one machine — use a real etcd cluster in production.

Autoscaling: with --autoscale, the SLO planner (`pdserve planner`) runs inside this process
and starts or drains local workers to hold the model's TTFT and ITL p90 targets, within
--min/--max replicas per pool. The targets are written to the registry at start, so
`pdserve slo set` changes them live, and `pdserve status` shows the planner's decisions."""

EXAMPLES = """examples:
  pdserve up --model ./tiny-llama
  pdserve profile --model ./tiny-llama --out tiny.json
  pdserve up --model ./tiny-llama --autoscale --profile tiny.json --ttft-p90 200ms --itl-p90 20ms --max-decode 4
  pdserve up --model ./Llama-3.1-8B --prefill 2 --decode 2 --port 50051
  pdserve generate --target 127.0.0.1:50051 --prompt "Hello" --max-tokens 32
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    up = commands.add_parser(
        "up",
        help="run frontend + prefill + decode workers on this machine",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    up.add_argument("--model", required=True, help="Hugging Face model directory")
    up.add_argument("--prefill", type=int, default=1, help="prefill workers (default: 1)")
    up.add_argument("--decode", type=int, default=1, help="decode workers (default: 1)")
    up.add_argument(
        "--etcd",
        default=os.environ.get("PDSERVE_ETCD"),
        help="etcd URL (default: $PDSERVE_ETCD, else the embedded registry)",
    )
    up.add_argument(
        "--threads-per-worker",
        type=int,
        default=None,
        help="torch CPU threads per worker (default: the CPUs shared evenly among the workers)",
    )
    add_frontend_args(up)
    add_engine_args(up)
    scaling = up.add_argument_group("autoscaling")
    scaling.add_argument("--autoscale", action="store_true", help="run the SLO planner over the local workers")
    scaling.add_argument("--ttft-p90", type=duration, metavar="DURATION", help="autoscale: p90 TTFT target, e.g. 500ms")
    scaling.add_argument("--itl-p90", type=duration, metavar="DURATION", help="autoscale: p90 ITL target, e.g. 30ms")
    for role in Role:
        scaling.add_argument(f"--max-{role}", type=int, default=4, metavar="N",
                             help=f"autoscale: most {role} workers (default: 4; the fewest is 1)")  # fmt: skip
    add_planner_args(scaling)
    up.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.prefill < 0 or args.decode < 1:
        raise ValueError(f"need --decode >= 1 and --prefill >= 0, got --prefill {args.prefill} --decode {args.decode}")
    if args.prefill == 0 and args.disaggregation == "always":
        raise ValueError("--disaggregation always needs --prefill >= 1")
    if not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"no config.json in model directory {args.model}")
    _check_port_free(args.host, args.port)
    planner = None
    if args.autoscale:
        if args.ttft_p90 is None or args.itl_p90 is None:
            raise ValueError("--autoscale needs --ttft-p90 and --itl-p90")
        if args.prefill < 1:
            raise ValueError("--autoscale needs --prefill >= 1 (a pool never goes below one worker)")
        from pdserve.discovery.slo import SLOTargets

        slo = SLOTargets(model=Path(args.model).resolve().name, ttft_p90_s=args.ttft_p90, itl_p90_s=args.itl_p90,
                         max_prefill_replicas=max(args.max_prefill, args.prefill),
                         max_decode_replicas=max(args.max_decode, args.decode))  # fmt: skip
        planner = (slo, *load_planner(args))
    return asyncio.run(_up(args, planner))


def _check_port_free(host: str, port: int) -> None:
    """Fail now, not after every worker has loaded its model, when the frontend's port is taken."""
    if port == 0:
        return
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror}); "
                         "choose another port, or 0 for any free one") from None  # fmt: skip


def _frontend_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--host", args.host, "--port", str(args.port), "--disaggregation", args.disaggregation,
            "--local-prefill-tokens", str(args.local_prefill_tokens),
            "--prefill-saturation-tokens", str(args.prefill_saturation_tokens),
            "--max-queued-requests", str(args.max_queued_requests), "--request-timeout", str(args.request_timeout),
            "--stats-window", str(args.stats_window)]  # fmt: skip
    if args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    if args.metrics_port != 0:
        argv += ["--metrics-port", str(args.metrics_port)]
    return argv


async def _up(args: argparse.Namespace, planner: tuple[SLOTargets, EngineProfile, PlannerConfig] | None) -> int:
    from pdserve.launch.local_cluster import ChildFailed, ClusterSpec, LocalCluster

    threads = args.threads_per_worker or max(1, (os.cpu_count() or 1) // (args.prefill + args.decode))
    cluster = LocalCluster(
        ClusterSpec(model=args.model, worker_args=tuple(engine_argv(args)), frontend_args=tuple(_frontend_argv(args)),
                    etcd=args.etcd, threads_per_worker=threads)
    )  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    start = loop.create_task(cluster.start(args.prefill, args.decode))
    stopped = loop.create_task(stop.wait())
    await asyncio.wait([start, stopped], return_when=asyncio.FIRST_COMPLETED)
    if not start.done():  # Ctrl-C during start-up
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        await cluster.stop()
        return 130
    try:
        start.result()
    except ChildFailed as exc:  # the cluster already stopped what it had started
        print(f"pdserve up: error: {exc}", file=sys.stderr)
        return 1
    assert cluster.frontend is not None
    registry = args.etcd or f"{cluster.etcd_url} (embedded)"
    print(f"pdserve is up: pdserve.v1.Inference on {cluster.frontend.address}; "
          f"{args.prefill} prefill + {args.decode} decode workers; registry {registry}", flush=True)  # fmt: skip
    autoscaler = await _start_autoscaler(cluster, planner, stop) if planner is not None else None
    try:
        while not stop.is_set():
            dead = cluster.exited()
            if dead:
                print(f"pdserve up: {', '.join(c.name for c in dead)} exited; stopping", flush=True)
                break
            try:
                async with asyncio.timeout(1.0):
                    await stop.wait()
            except TimeoutError:
                pass
    finally:
        if autoscaler is not None:
            await autoscaler()
        await cluster.stop()
    return 0 if stop.is_set() else 1


async def _start_autoscaler(
    cluster: LocalCluster, planner: tuple[SLOTargets, EngineProfile, PlannerConfig], stop: asyncio.Event
) -> Callable[[], Awaitable[None]]:
    """Write the SLO, start the planner over the cluster's workers; returns what stops it."""
    from pdserve.discovery.etcd import close_quietly, connect
    from pdserve.discovery.slo_store import put_slo
    from pdserve.launch.local_connector import LocalConnector
    from pdserve.planner.service import PlannerService

    slo, profile, config = planner
    assert cluster.etcd_url is not None
    client = await connect(cluster.etcd_url)
    try:
        await put_slo(client, slo)
    finally:
        await close_quietly(client)
    connector = LocalConnector(cluster)
    service = PlannerService(cluster.etcd_url, profile, lambda m: connector if m == slo.model else None, config)
    planner_stop = asyncio.Event()
    task = asyncio.get_running_loop().create_task(service.run(planner_stop), name="planner")
    print(f"pdserve up: autoscaling {slo.model} every {config.interval_s:g}s: TTFT p90 <= {slo.ttft_p90_s:g}s, "
          f"ITL p90 <= {slo.itl_p90_s:g}s, prefill 1..{slo.max_prefill_replicas}, "
          f"decode 1..{slo.max_decode_replicas}", flush=True)  # fmt: skip

    async def close() -> None:
        planner_stop.set()
        await asyncio.gather(task, return_exceptions=True)
        await connector.close()

    return close
