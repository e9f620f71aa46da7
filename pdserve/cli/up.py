"""``pdserve up``: a whole disaggregated deployment on this machine, in one command."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from pdserve.cli.common import add_engine_args, engine_argv
from pdserve.cli.serve import add_frontend_args

DESCRIPTION = """Start the frontend, N prefill workers and M decode workers as separate
processes on this machine (each with its own engine and NIXL agent), print where the API
listens, and serve until Ctrl-C or SIGTERM, which stops every process cleanly (workers drain).

Registry: with --etcd, that etcd. Without it, an embedded registry runs inside this process: a
minimal, in-memory etcd v3 server (KV and leases only, no persistence) that needs nothing
installed; it is for one machine — use a real etcd cluster in production."""

EXAMPLES = """examples:
  pdserve up --model ./tiny-llama
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
    up.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.prefill < 0 or args.decode < 1:
        raise ValueError(f"need --decode >= 1 and --prefill >= 0, got --prefill {args.prefill} --decode {args.decode}")
    if args.prefill == 0 and args.disaggregation == "always":
        raise ValueError("--disaggregation always needs --prefill >= 1")
    if not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"no config.json in model directory {args.model}")
    return asyncio.run(_up(args))


def _frontend_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--host", args.host, "--port", str(args.port), "--disaggregation", args.disaggregation,
            "--local-prefill-tokens", str(args.local_prefill_tokens),
            "--prefill-saturation-tokens", str(args.prefill_saturation_tokens),
            "--max-queued-requests", str(args.max_queued_requests), "--request-timeout", str(args.request_timeout)]  # fmt: skip
    if args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    if args.metrics_port != 0:
        argv += ["--metrics-port", str(args.metrics_port)]
    return argv


async def _up(args: argparse.Namespace) -> int:
    from pdserve.control_plane.local_cluster import ChildFailed, ClusterSpec, LocalCluster

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
    while not stop.is_set():
        dead = cluster.exited()
        if dead:
            print(f"pdserve up: {', '.join(c.name for c in dead)} exited; stopping", flush=True)
            break
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass
    await cluster.stop()
    return 0 if stop.is_set() else 1
