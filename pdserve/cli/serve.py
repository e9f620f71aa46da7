"""``pdserve prefill``, ``pdserve decode`` and ``pdserve frontend``: the long-running processes.

Each takes its configuration either from its options or whole from ``--config FILE`` (what
``pdserve up`` does for its children): a ``WorkerConfig`` or ``FrontendConfig`` as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import TypeVar

from pdserve.cli.common import (
    add_engine_args,
    add_field_option,
    from_options,
    given_fields,
    port_or_off,
    read_config,
    seconds,
)
from pdserve.engine.engine_config import EngineConfig
from pdserve.frontend.config import DISAGGREGATION_MODES, FrontendConfig, RouterConfig
from pdserve.worker.config import WorkerConfig
from pdserve.discovery.registry import Role

Config = TypeVar("Config", WorkerConfig, FrontendConfig)

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
WORKER_CONFIG_HELP = """the whole configuration instead of options: a WorkerConfig as JSON
(pdserve/worker/config.py; the engine's options under "engine"), as `pdserve up` writes it for
its workers; give no other option with it"""
FRONTEND_CONFIG_HELP = """the whole configuration instead of options: a FrontendConfig as JSON
(pdserve/frontend/config.py; routing under "router"), as `pdserve up` writes it for its
frontend; give no other option with it"""


def add_parsers(commands: argparse._SubParsersAction) -> None:
    for role in Role:
        p = commands.add_parser(
            role,
            help=f"run a {role} worker",
            description=WORKER_DESCRIPTION[role],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        source = p.add_mutually_exclusive_group(required=True)
        source.add_argument("--model", help="Hugging Face model directory")
        source.add_argument("--config", metavar="FILE", help=WORKER_CONFIG_HELP)
        p.add_argument("--etcd", help=ETCD_HELP)
        add_worker_args(p, role)
        add_engine_args(p)
        p.set_defaults(func=run_worker, role=role)

    f = commands.add_parser(
        "frontend",
        help="run the frontend (public gRPC API and router)",
        description="Serve pdserve.v1.Inference (plus gRPC health and reflection), "
        "routing each request to the workers registered in etcd.",
    )
    f.add_argument("--config", metavar="FILE", help=FRONTEND_CONFIG_HELP)
    f.add_argument("--etcd", help=ETCD_HELP)
    add_frontend_args(f)
    f.set_defaults(func=run_frontend)


def add_worker_args(parser: argparse.ArgumentParser, role: Role) -> None:
    """The ``WorkerConfig`` options of a ``role`` worker (its engine's: ``add_engine_args``)."""

    def option(flag: str, field: str, help: str, **kwargs: object) -> None:
        add_field_option(parser, flag, WorkerConfig, field, help=help, **kwargs)

    option("--model-name", "model_name", "served model name (default: the directory's name)")
    option("--host", "host", "listen address (default: {default})")
    option("--port", "port", "gRPC port (default: {default}; 0 picks a free one)", type=int)
    option("--advertise-host", "advertise_host", "host others reach this worker at (default: --host)")
    option("--worker-id", "worker_id", "name in the registry (default: ROLE-HOSTNAME-PID)")
    option("--lease-ttl", "lease_ttl_s", "registry lease TTL (default: {default:g}s)", type=seconds)
    option("--drain-timeout", "drain_timeout_s", "longest drain on SIGTERM (default: {default:g}s)", type=seconds)
    if role is Role.PREFILL:
        option("--hold", "hold_s", "longest a prompt's blocks stay pinned awaiting the pull (default: {default:g}s)",
               type=seconds)  # fmt: skip
    else:
        option("--transfer-timeout", "transfer_timeout_s", "deadline of one KV pull (default: {default:g}s)",
               type=seconds)  # fmt: skip
    option("--num-threads", "num_threads", "torch CPU threads (default: torch's)", type=int)
    option("--metrics-port", "metrics_port",
           "Prometheus /metrics port (default: {default}; 0 picks a free one, published in the registry; -1: off)",
           type=port_or_off)  # fmt: skip


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    """The ``FrontendConfig`` and ``RouterConfig`` options; build them with ``frontend_config``."""
    add_field_option(parser, "--host", FrontendConfig, "host", help="listen address (default: {default})")
    add_field_option(parser, "--port", FrontendConfig, "port", type=int, help="public gRPC port (default: {default})")
    add_field_option(
        parser, "--disaggregation", RouterConfig, "disaggregation", choices=DISAGGREGATION_MODES,
        help="always: every prompt on a prefill worker; off: on its decode worker (colocated); "
        "conditional: short uncached prompts, or any while the prefill pool is saturated, on the decode worker "
        "(default: {default})",
    )  # fmt: skip
    threshold = add_field_option(
        parser, "--local-prefill-threshold", RouterConfig, "local_prefill_threshold_tokens", type=int,
        metavar="TOKENS", help="conditional: prompts with at most this many uncached tokens prefill on the decode "
        "worker; the live knob of the same name (`pdserve knobs set`) replaces it (default: {default})",
    )  # fmt: skip
    # The option's name until the router's and the knob's settings became one; still accepted.
    parser.add_argument("--local-prefill-tokens", dest=threshold.dest, type=int, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)  # fmt: skip
    add_field_option(
        parser, "--prefill-saturation-tokens", RouterConfig, "prefill_saturation_tokens", type=int,
        help="conditional: queued prompt tokens at which a prefill worker counts as saturated (default: {default})",
    )  # fmt: skip
    add_field_option(
        parser, "--max-queued-requests", FrontendConfig, "max_queued_requests", type=int,
        help="requests in flight past which new ones get RESOURCE_EXHAUSTED (default: {default})",
    )  # fmt: skip
    add_field_option(
        parser, "--request-timeout", FrontendConfig, "request_timeout_s", type=seconds,
        help="deadline of a request whose caller set none (default: {default:g}s)",
    )  # fmt: skip
    add_field_option(
        parser, "--max-migrations", FrontendConfig, "max_migrations", type=int,
        help="times a request whose decode worker failed mid-stream goes on on another decode worker, keeping the "
        "tokens already streamed (default: {default}; 0: never)",
    )  # fmt: skip
    add_field_option(parser, "--tokenizer", FrontendConfig, "tokenizer",
                     help="tokenizer directory (default: the workers' model directory)")  # fmt: skip
    add_field_option(parser, "--metrics-port", FrontendConfig, "metrics_port", type=port_or_off,
                     help="Prometheus /metrics port (default: {default}; 0 picks a free one; -1: off)")  # fmt: skip
    add_field_option(
        parser, "--stats-window", FrontendConfig, "stats_window_s", type=seconds,
        help="span of the live latency percentiles published in etcd for `pdserve status` and the planner "
        "(default: {default:g}s; match the planner's interval)",
    )  # fmt: skip


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """A ``pdserve prefill|decode`` worker's configuration: its ``--config`` file, or its options."""
    if args.config:
        config = _config_file(args, WorkerConfig)
        if config.role != args.role:
            raise ValueError(f"--config {args.config} configures a {config.role} worker; run it with "
                             f"`pdserve {config.role}`")  # fmt: skip
        return config
    return from_options(args, WorkerConfig, role=args.role, model=args.model, etcd=_require_etcd(args),
                        engine=from_options(args, EngineConfig))  # fmt: skip


def frontend_config(args: argparse.Namespace, etcd: str) -> FrontendConfig:
    """The frontend's configuration from the options of ``add_frontend_args``."""
    return from_options(args, FrontendConfig, etcd=etcd, router=from_options(args, RouterConfig))


def _require_etcd(args: argparse.Namespace) -> str:
    etcd = args.etcd or os.environ.get("PDSERVE_ETCD")
    if not etcd:
        raise ValueError("--etcd is required (or set PDSERVE_ETCD); `pdserve up` runs an embedded one")
    return etcd


def _config_file(args: argparse.Namespace, struct: type[Config]) -> Config:
    """The configuration in ``--config``, which must come alone: an option beside it would be ignored."""
    given = [name.split(".", 1)[1] for name in given_fields(args)] + (["etcd"] if args.etcd else [])
    if given:
        raise ValueError(f"--config {args.config} is the whole configuration: set {', '.join(given)} in it, "
                         "not as options")  # fmt: skip
    return read_config(args.config, struct)


def run_worker(args: argparse.Namespace) -> int:
    config = worker_config(args)  # a bad one fails before torch is imported
    from pdserve.worker.main import serve

    asyncio.run(serve(config))
    return 0


def run_frontend(args: argparse.Namespace) -> int:
    config = _config_file(args, FrontendConfig) if args.config else frontend_config(args, _require_etcd(args))
    from pdserve.frontend.main import serve

    asyncio.run(serve(config))
    return 0
