"""``pdserve up``: a whole deployment on this machine, from start to Ctrl-C.

``up`` first checks what would otherwise fail only after every worker has loaded its model
(the model directory, the frontend's ports), then starts a ``LocalCluster``, and with
``autoscale`` the SLO planner over its pools; it prints where the API listens and serves until
SIGINT or SIGTERM, and then stops everything. Meanwhile the cluster restarts children that die
(``supervisor``); only a frontend or registry that keeps dying ends the deployment. While it
serves, its ``deployment_record`` in ``state_dir`` tells the ``pdserve`` commands run beside it
where the registry is and which credentials reach it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from pdserve.launch.deployment_record import DeploymentRecord, remove_record, write_record
from pdserve.launch.etcd_process import EtcdNotFound, find_etcd
from pdserve.launch.local_cluster import ChildFailed, ClusterSpec, LocalCluster
from pdserve.observability.metrics import serve_metrics

if TYPE_CHECKING:
    from pdserve.discovery.slo import SLOTargets
    from pdserve.planner.config import PlannerConfig
    from pdserve.planner.profile import EngineProfile
    from pdserve.worker.config import WorkerConfig


@dataclass(frozen=True)
class Autoscale:
    """The SLO planner over the cluster's pools: its targets (written to the registry at
    start), the engine profile it predicts from, and its settings."""

    slo: SLOTargets
    profile: EngineProfile
    config: PlannerConfig


@dataclass(frozen=True)
class UpSpec:
    """Attributes:
    cluster: the processes. A worker configuration without ``num_threads`` gets an even
        share of this machine's CPUs (each of its ranks does).
    num_prefill / num_decode: the workers to start with.
    autoscale: the planner to run over them, or None for fixed pools.
    metrics_port: where ``up`` serves its own Prometheus metrics (the children's restarts;
        0: a free port; None: off).
    state_dir: where to record the running deployment (``deployment_record``); None: nowhere.
    """

    cluster: ClusterSpec
    num_prefill: int
    num_decode: int
    autoscale: Autoscale | None = None
    metrics_port: int | None = 0
    state_dir: Path | None = None


def up(spec: UpSpec) -> int:
    """Serve until SIGINT or SIGTERM (0), or until a child fails to start, or the frontend or
    the registry dies past its restarts (1); workers that die are restarted meanwhile.

    Raises ValueError, before anything starts, when the model is neither a GGUF file nor a
    directory with a config.json, a port ``up`` serves (the frontend's, ``metrics_port``) is
    taken, or no etcd is given and none is installed to run.
    """
    model = Path(spec.cluster.decode.model)
    if model.suffix.lower() == ".gguf":
        if not model.is_file():
            raise ValueError(f"GGUF file not found: {model}")
    elif not (model / "config.json").is_file():
        raise ValueError(f"no config.json in model directory {model}")
    frontend = spec.cluster.frontend
    _check_port_free(frontend.host, frontend.port, "--port")
    if frontend.http_port is not None:
        _check_port_free(frontend.host, frontend.http_port, "--http-port")
    if spec.metrics_port is not None:
        _check_port_free(frontend.host, spec.metrics_port, "--up-metrics-port")
    if spec.cluster.etcd is None:
        try:
            find_etcd()
        except EtcdNotFound as exc:
            raise ValueError(str(exc)) from None
    return asyncio.run(_serve(_with_thread_share(spec)))


def _with_thread_share(spec: UpSpec) -> UpSpec:
    """Workers given no thread count share this machine's CPUs evenly, rank by rank."""
    cluster = spec.cluster
    num_ranks = (
        spec.num_prefill * cluster.prefill.parallel.world_size + spec.num_decode * cluster.decode.parallel.world_size
    )
    share = max(1, (os.cpu_count() or 1) // max(num_ranks, 1))

    def shared(config: WorkerConfig) -> WorkerConfig:
        return config if config.num_threads is not None else msgspec.structs.replace(config, num_threads=share)

    return replace(spec, cluster=replace(cluster, prefill=shared(cluster.prefill), decode=shared(cluster.decode)))


def _check_port_free(host: str, port: int, option: str) -> None:
    """Fail now, not after every worker has loaded its model, when a port ``up`` serves is taken."""
    if port == 0:
        return
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise ValueError(
            f"{option} {port}: cannot listen on {host}:{port} ({exc.strerror}); "
            "choose another port, or 0 for any free one"
        ) from None


async def _serve(spec: UpSpec) -> int:
    cluster = LocalCluster(spec.cluster)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    start = loop.create_task(cluster.start(spec.num_prefill, spec.num_decode))
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
    autoscaler = None
    failed = loop.create_task(cluster.failed.wait())
    try:
        if spec.metrics_port is not None:
            host = spec.cluster.frontend.host
            metrics_port = serve_metrics(cluster.metrics.registry, host, spec.metrics_port)
            print(f"pdserve up metrics (child restarts) on http://{host}:{metrics_port}/metrics", flush=True)
        assert cluster.frontend is not None
        if cluster.tools_tls is not None:
            print(
                f"pdserve up: workers and registry take only this deployment's certificates (cluster mTLS, "
                f"CA {cluster.tools_tls.ca})",
                flush=True,
            )
        if spec.state_dir is not None:
            record = DeploymentRecord(
                pid=os.getpid(),
                etcd=cluster.etcd_url or "",
                etcd_tls=cluster.etcd_auth.tls,
                cluster_tls=cluster.tools_tls,
                api=cluster.frontend.address,
            )
            path = write_record(spec.state_dir, record)
            print(f"pdserve up: `pdserve status`, `workers`, `drain` here reach it through {path}", flush=True)
        registry = spec.cluster.etcd or f"{cluster.etcd_url} (embedded)"
        http = f", OpenAI API on {cluster.frontend.http_url}" if cluster.frontend.http_url else ""
        print(
            f"pdserve is up: pdserve.v1.Inference on {cluster.frontend.address}{http}; "
            f"{spec.num_prefill} prefill + {spec.num_decode} decode workers; registry {registry}",
            flush=True,
        )
        autoscaler = await _start_autoscaler(cluster, spec.autoscale) if spec.autoscale is not None else None
        await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():
            print(f"pdserve up: {cluster.failure}; stopping", flush=True)
    finally:
        for task in (stopped, failed):
            task.cancel()
        await asyncio.gather(stopped, failed, return_exceptions=True)
        if spec.state_dir is not None:
            remove_record(spec.state_dir, os.getpid())
        if autoscaler is not None:
            await autoscaler()
        await cluster.stop()
    return 0 if stop.is_set() else 1


async def _start_autoscaler(cluster: LocalCluster, autoscale: Autoscale) -> Callable[[], Awaitable[None]]:
    """Write the SLO, start the planner over the cluster's workers; returns what stops it."""
    from pdserve.discovery.etcd import close_quietly, connect
    from pdserve.discovery.slo_store import put_slo
    from pdserve.launch.local_connector import LocalConnector
    from pdserve.planner.service import PlannerService

    slo, config = autoscale.slo, autoscale.config
    assert cluster.etcd_url is not None
    auth = cluster.etcd_auth
    client = await connect(cluster.etcd_url, auth=auth)
    try:
        await put_slo(client, slo)
    finally:
        await close_quietly(client)
    connector = LocalConnector(cluster)
    service = PlannerService(
        cluster.etcd_url, autoscale.profile, lambda m: connector if m == slo.model else None, config, auth
    )
    planner_stop = asyncio.Event()
    task = asyncio.get_running_loop().create_task(service.run(planner_stop), name="planner")
    print(
        f"pdserve up: autoscaling {slo.model} every {config.interval_s:g}s: TTFT p90 <= {slo.ttft_p90_s:g}s, "
        f"ITL p90 <= {slo.itl_p90_s:g}s, prefill 1..{slo.max_prefill_replicas}, "
        f"decode 1..{slo.max_decode_replicas}",
        flush=True,
    )

    async def close() -> None:
        planner_stop.set()
        await asyncio.gather(task, return_exceptions=True)
        await connector.close()

    return close
