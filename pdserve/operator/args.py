"""The one place where a PDServeDeployment's fields become command lines.

Each component's arguments go into the deployment's ConfigMap as one file per component (one
argument a line), and the pod runs ``pdserve @/etc/pdserve/config/ROLE.args`` plus the few
arguments only the pod knows (its name and IP). A field that a worker or frontend option
grows later is mapped here and nowhere else.

Secrets never enter a command line or the ConfigMap: a Secret's files are mounted and named by
path (``--cluster-ca``, ``--etcd-cacert``, ``--api-key-file``), and the etcd user and password
reach the process as ``$PDSERVE_ETCD_USER`` and ``$PDSERVE_ETCD_PASSWORD`` from the Secret
(``etcd_env``).

Engine arguments are camelCase keys turned into the worker's options: ``maxNumSeqs: 64`` is
``--max-num-seqs 64``; ``true`` gives the bare flag, ``false`` leaves it out.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from pdserve.frontend.config import Disaggregation, RouterConfig
from pdserve.types.duration import parse_duration
from pdserve.operator.spec import DeploymentSpec, EngineArg, PoolSpec
from pdserve.worker.config import WorkerConfig

CONFIG_DIR = "/etc/pdserve/config"
TLS_DIR = "/etc/pdserve/tls"
API_KEY_DIR = "/etc/pdserve/api-key"
CLUSTER_TLS_DIR = "/etc/pdserve/cluster-tls"
ETCD_TLS_DIR = "/etc/pdserve/etcd-tls"
PROFILE_DIR = "/etc/pdserve/profile"
# Without spec.planner.profileConfigMap: the profile pdserve ships for the model, in the ConfigMap.
BUILTIN_PROFILE = "profile.json"
WORKER_PORT = 50051
METRICS_PORT = 9090
# Where a multi-pod group's leader (rank 0) takes its ranks' rendezvous (the worker's default).
RENDEZVOUS_PORT = 29500
# How long a multi-pod group's ranks wait for each other. The kubelet restarts a crashed
# container after a back-off that grows to 5 minutes, separately for each pod, so after a
# failure the ranks of a group come back minutes apart: the window must outlast that back-off
# for them ever to meet (engineArgs.rendezvousTimeout overrides it).
POD_GROUP_RENDEZVOUS_S = 900
# Beyond the drain: closing the server, the NIXL agent and the lease, and the preStop's own start.
SHUTDOWN_MARGIN_S = 15


def flag(key: str) -> str:
    """``maxNumSeqs`` → ``--max-num-seqs``."""
    return "--" + re.sub(r"(?<!^)(?=[A-Z])", "-", key).lower()


def options(values: dict[str, EngineArg]) -> list[str]:
    """camelCase keys and scalar values as command-line options, in the order given."""
    argv: list[str] = []
    for key, value in values.items():
        if value is True:
            argv.append(flag(key))
        elif value is not False:
            argv += [flag(key), str(value)]
    return argv


def etcd_url(spec: DeploymentSpec, default: str | None) -> str:
    """The registry the deployment's processes use: its own endpoint, else the operator's default."""
    if spec.etcd.endpoints:
        return spec.etcd.endpoints[0]
    if default:
        return default
    raise ValueError("spec.etcd.endpoints is empty and the operator has no default etcd (pdserve operator --etcd)")


def cluster_tls_args(spec: DeploymentSpec) -> list[str]:
    """``--cluster-*`` of a worker, the frontend and a worker's preStop drain, with ``spec.clusterTLS``."""
    if spec.cluster_tls is None:
        return []
    return [
        "--cluster-ca",
        f"{CLUSTER_TLS_DIR}/ca.crt",
        "--cluster-cert",
        f"{CLUSTER_TLS_DIR}/tls.crt",
        "--cluster-key",
        f"{CLUSTER_TLS_DIR}/tls.key",
    ]


def etcd_tls_args(spec: DeploymentSpec) -> list[str]:
    """``--etcd-cacert`` and the rest of etcd's TLS options, from ``spec.etcd``."""
    etcd = spec.etcd
    argv: list[str] = []
    if etcd.tls is not None:
        argv += ["--etcd-cacert", f"{ETCD_TLS_DIR}/ca.crt"]
        if etcd.tls.client_certificate:
            argv += ["--etcd-cert", f"{ETCD_TLS_DIR}/tls.crt", "--etcd-key", f"{ETCD_TLS_DIR}/tls.key"]
    if etcd.server_name is not None:
        argv += ["--etcd-server-name", etcd.server_name]
    return argv


def etcd_env(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """The container env that signs a component in to etcd as ``spec.etcd.auth``'s user: both
    values taken from the Secret by the kubelet, so neither is written anywhere else."""
    if spec.etcd.auth is None:
        return []
    secret = spec.etcd.auth.secret_name
    return [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
        for name, key in (("PDSERVE_ETCD_USER", "username"), ("PDSERVE_ETCD_PASSWORD", "password"))
    ]


def worker_args(spec: DeploymentSpec, role: str, etcd: str) -> list[str]:
    """``pdserve prefill|decode`` arguments shared by every pod of the pool."""
    pool: PoolSpec = getattr(spec, role)
    argv = [
        role,
        "--model",
        spec.model.path,
        "--model-name",
        spec.model.served_name,
        "--etcd",
        etcd,
        "--host",
        "0.0.0.0",
        "--port",
        str(WORKER_PORT),
        "--metrics-port",
        str(METRICS_PORT),
    ]
    # Parallelism options only where they differ from one rank: a single-GPU pool's command
    # line then runs on every worker build.
    if pool.tensor_parallel_size != 1:
        argv += ["--tensor-parallel-size", str(pool.tensor_parallel_size)]
    if pool.data_parallel_size != 1:
        argv += ["--data-parallel-size", str(pool.data_parallel_size)]
    if pool.enable_expert_parallel:
        argv.append("--enable-expert-parallel")
    if pool.multi_node:
        argv += ["--rendezvous-timeout", str(POD_GROUP_RENDEZVOUS_S)]
    return argv + cluster_tls_args(spec) + etcd_tls_args(spec) + options(pool.engine_args)


def pod_worker_args() -> list[str]:
    """What only the pod knows; Kubernetes expands ``$(VAR)`` from the container's env."""
    return ["--worker-id", "$(POD_NAME)", "--advertise-host", "$(POD_IP)"]


def group_args(leader_host: str, group_size: int) -> list[str]:
    """What a rank of a multi-pod group adds to its pool's arguments when nothing sets the
    LeaderWorkerSet env for it: where its leader listens and how many ranks meet there. The
    rank's own index (``--group-index``) is the pod's to know."""
    return ["--leader-address", f"{leader_host}:{RENDEZVOUS_PORT}", "--group-size", str(group_size)]


def frontend_args(spec: DeploymentSpec, etcd: str) -> list[str]:
    fe, router = spec.frontend, spec.router
    argv = [
        "frontend",
        "--etcd",
        etcd,
        "--host",
        "0.0.0.0",
        "--port",
        str(fe.grpc_port),
        "--http-port",
        str(fe.http_port),
        "--metrics-port",
        str(METRICS_PORT),
    ]
    if router.disaggregation is not None:
        argv += ["--disaggregation", router.disaggregation]
    if router.local_prefill_threshold_tokens is not None:
        argv += ["--local-prefill-threshold", str(router.local_prefill_threshold_tokens)]
    if router.prefill_saturation_tokens is not None:
        argv += ["--prefill-saturation-tokens", str(router.prefill_saturation_tokens)]
    if spec.tls is not None:
        argv += ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key"]
    if spec.api_keys is not None:
        argv += ["--api-key-file", f"{API_KEY_DIR}/{spec.api_keys.key}"]
    return argv + cluster_tls_args(spec) + etcd_tls_args(spec) + options(fe.args)


def disaggregation(spec: DeploymentSpec) -> Disaggregation:
    """The mode the frontend runs with: ``frontend.args`` come last on its command line, so
    they win over ``router``; neither gives the frontend's own default."""
    mode = spec.frontend.args.get("disaggregation", spec.router.disaggregation)
    if mode is None:
        return next(f.default for f in msgspec.structs.fields(RouterConfig) if f.name == "disaggregation")
    return mode


def planner_args(spec: DeploymentSpec, namespace: str, name: str, etcd: str) -> list[str]:
    argv = [
        "planner",
        "--etcd",
        etcd,
        "--connector",
        "kubernetes",
        "--namespace",
        namespace,
        "--deployment",
        f"{spec.model.served_name}={name}",
        "--profile",
        f"{PROFILE_DIR}/profile.json" if spec.planner.profile_config_map else f"{CONFIG_DIR}/{BUILTIN_PROFILE}",
        "--metrics-port",
        str(METRICS_PORT),
    ]
    if spec.planner.interval:
        argv += ["--planner-interval", spec.planner.interval]
    return argv + etcd_tls_args(spec)


def _worker_default(name: str) -> float:
    return next(f.default for f in msgspec.structs.fields(WorkerConfig) if f.name == name)


def _seconds(pool: PoolSpec, key: str, default: float, role: str) -> float:
    value = pool.engine_args.get(key)
    if value is None:
        return default
    try:
        return parse_duration(str(value)) if isinstance(value, str) else float(value)
    except ValueError as error:
        raise ValueError(f"spec.{role}.engineArgs.{key}: {error}") from None


def drain_seconds(pool: PoolSpec, role: str) -> float:
    """The worker's drain deadline (its ``--drain-timeout``)."""
    return _seconds(pool, "drainTimeout", _worker_default("drain_timeout_s"), role)


def grace_seconds(pool: PoolSpec, role: str) -> int:
    """``terminationGracePeriodSeconds`` of a worker pod: the drain deadline, plus the KV
    deadline of a request admitted just before it (a prefill pin's hold, a decode pull's
    transfer timeout), plus the shutdown itself, so Kubernetes never kills a worker that is
    still within its own deadlines."""
    if role == "prefill":
        kv = _seconds(pool, "hold", _worker_default("hold_s"), role)
    else:
        kv = _seconds(pool, "transferTimeout", _worker_default("transfer_timeout_s"), role)
    return int(drain_seconds(pool, role) + kv + SHUTDOWN_MARGIN_S + 0.999)


def prestop_command(spec: DeploymentSpec, role: str) -> list[str]:
    """The preStop hook: drain the worker in this pod and wait until its work is done. A worker
    serving the cluster's mTLS admits the drain by the pod's cluster certificate."""
    wait = grace_seconds(getattr(spec, role), role) - SHUTDOWN_MARGIN_S
    argv = ["pdserve", "drain", "--endpoint", f"127.0.0.1:{WORKER_PORT}", "--wait", "--timeout", f"{wait:g}s"]
    return argv + cluster_tls_args(spec)


def args_file(argv: list[str]) -> str:
    """One argument a line, as ``pdserve @FILE`` reads it."""
    for arg in argv:
        if "\n" in arg:
            raise ValueError(f"an argument may not contain a newline: {arg!r}")
    return "\n".join(argv) + "\n"
