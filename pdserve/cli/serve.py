"""``pdserve prefill``, ``pdserve decode`` and ``pdserve frontend``: the long-running processes.

Each takes its configuration either from its options or whole from ``--config FILE`` (what
``pdserve up`` does for its children): a ``WorkerConfig`` or ``FrontendConfig`` as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any, TypeVar

import msgspec

from pdserve import environment
from pdserve.cli.frontend_args import add_frontend_args, frontend_config
from pdserve.cli.group_args import add_group_args, group_placement
from pdserve.cli.secrets import add_secret_option, secret
from pdserve.cli.common import (
    add_cluster_tls_args,
    add_engine_args,
    add_etcd_auth_args,
    add_field_option,
    cluster_tls,
    duration,
    etcd_auth,
    from_options,
    given_etcd_auth_options,
    given_fields,
    port_or_off,
    read_config,
)
from pdserve.discovery.registry import Role
from pdserve.distributed.parallel_config import ParallelConfig
from pdserve.frontend.config import FrontendConfig
from pdserve.model.default_model import resolve_model
from pdserve.types.engine_config import EngineConfig
from pdserve.worker.config import WorkerConfig

Config = TypeVar("Config", WorkerConfig, FrontendConfig)

WORKER_DESCRIPTION = {
    Role.PREFILL: """Run a prefill worker: it computes prompts' KV and first tokens and keeps each
prompt's KV blocks pinned until a decode worker has pulled them over NIXL. It registers in etcd
under a lease (key /pdserve/v1/workers/MODEL/prefill/ID) and refreshes its load about every
second; SIGTERM drains it (no new work, in-flight work finishes) and revokes the lease.
Its KV blocks leave over NIXL unencrypted and unauthenticated: keep that traffic on a trusted
network (README: Security).""",
    Role.DECODE: """Run a decode worker: it pulls prompts' KV from prefill workers over NIXL (or
computes short prompts itself) and streams the generated tokens. It registers in etcd under a
lease (key /pdserve/v1/workers/MODEL/decode/ID); SIGTERM drains it: in-flight streams finish.
Its KV pulls over NIXL are unencrypted and unauthenticated: keep that traffic on a trusted
network (README: Security).""",
}
ETCD_HELP = "etcd URL, e.g. http://127.0.0.1:2379 (default: $PDSERVE_ETCD)"
WORKER_CONFIG_HELP = """the whole configuration instead of options: a WorkerConfig as JSON
(pdserve/worker/config.py; the engine's options under "engine"), as `pdserve up` writes it for
its workers; give no other option with it"""
FRONTEND_CONFIG_HELP = """the whole configuration instead of options: a FrontendConfig as JSON
(pdserve/frontend/config.py; routing under "router"), as `pdserve up` writes it for its
frontend; give no other option with it"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    for role in Role:
        p = commands.add_parser(
            role,
            help=f"run a {role} worker",
            description=WORKER_DESCRIPTION[role],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        source = p.add_mutually_exclusive_group()
        source.add_argument(
            "--model",
            help="a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or a GGUF file (default: the set-up's SmolLM2-135M-Instruct)",
        )
        source.add_argument("--config", metavar="FILE", help=WORKER_CONFIG_HELP)
        p.add_argument("--etcd", help=ETCD_HELP)
        add_worker_args(p, role)
        add_worker_security_args(p)
        add_etcd_auth_args(p)
        add_engine_args(p)
        p.set_defaults(func=run_worker, role=role)

    f = commands.add_parser(
        "frontend",
        help="run the frontend (public gRPC and OpenAI HTTP APIs, router)",
        description="Serve pdserve.v1.Inference (plus gRPC health and reflection) and the OpenAI-compatible "
        "HTTP API (/v1/models, /v1/completions, /v1/chat/completions, /health), routing each request to the "
        "workers registered in etcd.",
    )
    f.add_argument("--config", metavar="FILE", help=FRONTEND_CONFIG_HELP)
    f.add_argument("--etcd", help=ETCD_HELP)
    add_frontend_args(f)
    add_cluster_tls_args(f, "calls to the workers go over mTLS with it")
    add_etcd_auth_args(f)
    f.set_defaults(func=run_frontend)


def add_worker_security_args(parser: argparse.ArgumentParser) -> None:
    """A worker's cluster mTLS and admin key (``pdserve prefill|decode`` and ``pdserve up``)."""
    add_cluster_tls_args(
        parser,
        "internal gRPC servers serve only clients with a certificate it signed, and internal clients present theirs",
    )
    add_secret_option(
        parser,
        "--admin-key",
        env="PDSERVE_ADMIN_KEY",
        help="the key `pdserve drain --admin-key-file` must give when the caller has no cluster "
        "certificate; with neither, Drain is open",
    )


def add_worker_args(parser: argparse.ArgumentParser, role: Role) -> None:
    """The ``WorkerConfig`` options of a ``role`` worker (its engine's: ``add_engine_args``)."""

    def option(flag: str, field: str, help: str, **kwargs: object) -> None:
        add_field_option(parser, flag, WorkerConfig, field, help=help, **kwargs)

    option(
        "--model-name",
        "model_name",
        "served model name (default: the directory's name, or a GGUF file's less its quantization suffix)",
    )
    option("--host", "host", "listen address (default: {default})")
    option("--port", "port", "gRPC port (default: {default}; 0 picks a free one)", type=int)
    option("--advertise-host", "advertise_host", "host others reach this worker at (default: --host)")
    option("--worker-id", "worker_id", "name in the registry (default: ROLE-HOSTNAME-PID)")
    option("--lease-ttl", "lease_ttl_s", "registry lease TTL (default: {default:g}s)", type=duration)
    option("--drain-timeout", "drain_timeout_s", "longest drain on SIGTERM (default: {default:g}s)", type=duration)
    option(
        "--liveness-deadline",
        "liveness_deadline_s",
        "/livez fails when the engine has made no progress for this long (default: {default:g}s)",
        type=duration,
    )
    if role is Role.PREFILL:
        option(
            "--hold",
            "hold_s",
            "longest a prompt's blocks stay pinned awaiting the pull (default: {default:g}s)",
            type=duration,
        )
    else:
        option(
            "--transfer-timeout", "transfer_timeout_s", "deadline of one KV pull (default: {default:g}s)", type=duration
        )
    option("--num-threads", "num_threads", "torch CPU threads (default: torch's)", type=int)
    add_field_option(
        parser,
        "--tensor-parallel-size",
        ParallelConfig,
        "tensor_parallel_size",
        type=int,
        help="ranks (processes) to split the model over, each moving its own KV heads over NIXL (default: {default})",
    )
    add_field_option(
        parser,
        "--data-parallel-size",
        ParallelConfig,
        "data_parallel_size",
        type=int,
        help="data-parallel attention ranks sharing a MoE model's experts (needs "
        "--enable-expert-parallel): each rank serves as a worker of its own, WORKER_ID-dpR past "
        "rank 0, all stepping together (default: {default})",
    )
    add_field_option(
        parser,
        "--enable-expert-parallel",
        ParallelConfig,
        "enable_expert_parallel",
        action="store_true",
        help="spread each MoE layer's experts over the ranks",
    )
    add_group_args(parser)
    option(
        "--metrics-port",
        "metrics_port",
        "Prometheus /metrics port (default: {default}; 0 picks a free one, published in the registry; -1: off)",
        type=port_or_off,
    )


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """A ``pdserve prefill|decode`` worker's configuration: its ``--config`` file, or its options."""
    if args.config:
        config = _config_file(args, WorkerConfig)
        if config.role != args.role:
            raise ValueError(
                f"--config {args.config} configures a {config.role} worker; run it with `pdserve {config.role}`"
            )
        # A rank's place is its own, not the group's: it may come beside the shared file.
        placement = group_placement(args)
        return config if placement is None else msgspec.structs.replace(config, placement=placement)
    return from_options(
        args,
        WorkerConfig,
        role=args.role,
        model=resolve_model(args.model),
        etcd=_require_etcd(args),
        engine=from_options(args, EngineConfig),
        parallel=from_options(args, ParallelConfig),
        placement=group_placement(args),
        **worker_security(args),
    )


def worker_security(args: argparse.Namespace) -> dict[str, Any]:
    """A worker's security fields from the options (``add_worker_security_args``, ``add_etcd_auth_args``)."""
    return {
        "cluster_tls": cluster_tls(args),
        "admin_key": secret(args, "admin_key", environment.admin_key()),
        "etcd_auth": etcd_auth(args),
    }


def _require_etcd(args: argparse.Namespace) -> str:
    etcd = args.etcd or environment.etcd_url()
    if not etcd:
        raise ValueError("--etcd is required (or set PDSERVE_ETCD); `pdserve up` runs an embedded one")
    return etcd


def _config_file(args: argparse.Namespace, struct: type[Config]) -> Config:
    """The configuration in ``--config``, which must come alone: an option beside it would be ignored."""
    given = [name.split(".", 1)[1] for name in given_fields(args)] + (["etcd"] if args.etcd else [])
    security = ["tls_cert", "tls_key", "tls_client_ca", "cluster_ca", "cluster_cert", "cluster_key", "admin_key"]
    security.append("admin_key_file")
    given += [name for name in security if getattr(args, name, None)] + given_etcd_auth_options(args)
    if given:
        raise ValueError(
            f"--config {args.config} is the whole configuration: set {', '.join(given)} in it, not as options"
        )
    return read_config(args.config, struct)


def run_worker(args: argparse.Namespace) -> int:
    config = worker_config(args)  # a bad one fails before torch is imported
    from pdserve.worker.main import run

    return run(config)


def run_frontend(args: argparse.Namespace) -> int:
    if args.config and (args.api_key or args.api_key_file):
        raise ValueError(f"--config {args.config} is the whole configuration: set api_keys in it, not as options")
    config = _config_file(args, FrontendConfig) if args.config else frontend_config(args, _require_etcd(args))
    from pdserve.frontend.main import serve

    asyncio.run(serve(config))
    return 0
