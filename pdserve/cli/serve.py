"""``pdserve prefill``, ``pdserve decode`` and ``pdserve frontend``: the long-running processes."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import TYPE_CHECKING

from pdserve.cli.common import add_engine_args, engine_config, seconds
from pdserve.discovery.registry import Role

if TYPE_CHECKING:
    from pdserve.frontend.service import FrontendConfig

WORKER_DESCRIPTION = {
    Role.PREFILL: """Run a prefill worker: it computes prompts' KV and first tokens and keeps each
prompt's KV blocks pinned until a decode worker has pulled them over NIXL. It registers in etcd
under a lease (key /pdserve/v1/workers/MODEL/prefill/ID) and refreshes its load about every
second; SIGTERM drains it (no new work, in-flight work finishes) and revokes the lease.""",
    Role.DECODE: """Run a decode worker: it pulls prompts' KV from prefill workers over NIXL (or
computes short prompts itself) and streams the generated tokens. It registers in etcd under a
lease (key /pdserve/v1/workers/MODEL/decode/ID); SIGTERM drains it: in-flight streams finish.""",
}
ETCD_HELP = "etcd URL, e.g. http://127.0.0.1:2379 (default: $PDSERVE_ETCD)"


def add_parsers(commands: argparse._SubParsersAction) -> None:
    for role in Role:
        p = commands.add_parser(
            role,
            help=f"run a {role} worker",
            description=WORKER_DESCRIPTION[role],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("--model", required=True, help="Hugging Face model directory")
        p.add_argument("--etcd", default=os.environ.get("PDSERVE_ETCD"), help=ETCD_HELP)
        p.add_argument("--model-name", default=None, help="served model name (default: the directory's name)")
        p.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
        p.add_argument("--port", type=int, default=0, help="gRPC port (default: 0, a free one)")
        p.add_argument("--advertise-host", default=None, help="host others reach this worker at (default: --host)")
        p.add_argument("--worker-id", default=None, help="name in the registry (default: ROLE-HOSTNAME-PID)")
        p.add_argument("--lease-ttl", type=seconds, default=5.0, help="registry lease TTL (default: 5s)")
        p.add_argument("--drain-timeout", type=seconds, default=60.0, help="longest drain on SIGTERM (default: 60s)")
        if role is Role.PREFILL:
            p.add_argument(
                "--hold",
                type=seconds,
                default=30.0,
                help="longest a prompt's blocks stay pinned awaiting the pull (default: 30s)",
            )
        else:
            p.add_argument(
                "--transfer-timeout", type=seconds, default=30.0, help="deadline of one KV pull (default: 30s)"
            )
        p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
        p.add_argument(
            "--metrics-port",
            type=int,
            default=0,
            help="Prometheus /metrics port (default: 0, a free one, published in the registry; -1: off)",
        )
        add_engine_args(p)
        p.set_defaults(func=run_worker, role=role)

    f = commands.add_parser(
        "frontend",
        help="run the frontend (public gRPC API and router)",
        description="Serve pdserve.v1.Inference (plus gRPC health and reflection), "
        "routing each request to the workers registered in etcd.",
    )
    f.add_argument("--etcd", default=os.environ.get("PDSERVE_ETCD"), help=ETCD_HELP)
    add_frontend_args(f)
    f.set_defaults(func=run_frontend)


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50051, help="public gRPC port (default: 50051)")
    parser.add_argument(
        "--disaggregation",
        choices=["always", "conditional", "off"],
        default="conditional",
        help="always: every prompt on a prefill worker; off: on its decode worker (colocated); "
        "conditional (default): short uncached prompts, or any while the prefill pool is "
        "saturated, on the decode worker",
    )
    parser.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=64,
        help="conditional: prompts with at most this many uncached tokens prefill on the decode worker (default: 64)",
    )
    parser.add_argument(
        "--prefill-saturation-tokens",
        type=int,
        default=8192,
        help="conditional: queued prompt tokens at which a prefill worker counts as saturated (default: 8192)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests in flight past which new ones get RESOURCE_EXHAUSTED (default: 1024)",
    )
    parser.add_argument(
        "--request-timeout",
        type=seconds,
        default=600.0,
        help="deadline of a request whose caller set none (default: 600s)",
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the workers' model directory)")
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus /metrics port (default: 0, a free one; -1: off)"
    )
    parser.add_argument(
        "--stats-window",
        type=seconds,
        default=10.0,
        help="span of the live latency percentiles published in etcd for `pdserve status` and the planner "
        "(default: 10s, the planner's interval)",
    )


def _require_etcd(args: argparse.Namespace) -> str:
    if not args.etcd:
        raise ValueError("--etcd is required (or set PDSERVE_ETCD); `pdserve up` runs an embedded one")
    return args.etcd


def run_worker(args: argparse.Namespace) -> int:
    import torch

    from pdserve.worker.config import WorkerConfig
    from pdserve.worker.main import serve

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    extra = {"hold_s": args.hold} if args.role is Role.PREFILL else {"transfer_timeout_s": args.transfer_timeout}
    config = WorkerConfig(
        role=args.role, model=args.model, etcd=_require_etcd(args), model_name=args.model_name, host=args.host,
        port=args.port, advertise_host=args.advertise_host, worker_id=args.worker_id, lease_ttl_s=args.lease_ttl,
        drain_timeout_s=args.drain_timeout, metrics_port=None if args.metrics_port < 0 else args.metrics_port, **extra,
    )  # fmt: skip
    asyncio.run(serve(config, engine_config(args)))
    return 0


def frontend_config(args: argparse.Namespace, etcd: str) -> FrontendConfig:
    from pdserve.frontend.router import RouterConfig
    from pdserve.frontend.service import FrontendConfig

    return FrontendConfig(
        etcd=etcd, host=args.host, port=args.port,
        router=RouterConfig(disaggregation=args.disaggregation, local_prefill_tokens=args.local_prefill_tokens,
                            prefill_saturation_tokens=args.prefill_saturation_tokens),
        max_queued_requests=args.max_queued_requests, request_timeout_s=args.request_timeout, tokenizer=args.tokenizer,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port, stats_window_s=args.stats_window,
    )  # fmt: skip


def run_frontend(args: argparse.Namespace) -> int:
    from pdserve.frontend.main import serve

    asyncio.run(serve(frontend_config(args, _require_etcd(args))))
    return 0
