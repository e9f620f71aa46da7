"""Run the frontend process: watch the registry, serve the public APIs until stopped.

gRPC (grpc.aio) and the OpenAI HTTP API (uvicorn) share one event loop and one ``Gateway``:
the same admission, validation, routing and metrics for both. The metrics port also serves the
probes: ``/readyz`` once some model has a serving worker of each pool its requests need (a
decode worker; a prefill worker too under ``disaggregation: always``), and not while stopping;
``/livez`` while the event loop answers.
"""

from __future__ import annotations

import asyncio
import signal
import socket

from pdserve.discovery.etcd import EtcdConnection
from pdserve.discovery.registration import LeasedRecord
from pdserve.discovery.registry import Role, frontend_key
from pdserve.discovery.registry_view import RegistryView
from pdserve.frontend.auth import ApiKeyInterceptor, ApiKeys
from pdserve.frontend.config import FrontendConfig
from pdserve.frontend.gateway import Gateway
from pdserve.frontend.openai_api.app import create_app
from pdserve.frontend.openai_api.connection_guard import ConnectionGuard
from pdserve.frontend.openai_api.server import HttpServer
from pdserve.frontend.rate_limit import RateLimiter
from pdserve.frontend.service import INFERENCE_SERVICE, InferenceService
from pdserve.lifecycle import install_stack_dump
from pdserve.observability.probes import MetricsServer, Probes, on_loop
from pdserve.rpc.server import RpcServer
from pdserve.v1 import inference_pb2_grpc

# How long a probe waits for the event loop: one that does not answer in this long is not live.
_LOOP_ANSWER_S = 2.0


async def serve(config: FrontendConfig) -> None:
    """Serve until SIGTERM or SIGINT; in-flight streams get a few seconds to finish.

    With ``config.tls`` both public APIs, gRPC and HTTP, serve TLS only (mTLS with its client CA).
    """
    etcd = EtcdConnection(config.etcd, auth=config.etcd_auth)  # the process's one client, closed last
    view = RegistryView(etcd)
    try:
        await view.start()
    except BaseException:
        await etcd.close()
        raise
    gateway = Gateway(config, view)
    keys = ApiKeys(config.api_keys, salt_from_key=config.cache_salt_from_key)
    limiter = RateLimiter(config.rate_limit_rps, config.rate_limit_burst) if config.rate_limit_rps else None
    service = InferenceService(gateway, keys)
    guarded = keys.required or limiter is not None
    server = RpcServer(tls=config.tls, interceptors=[ApiKeyInterceptor(keys, limiter)] if guarded else [])
    server.add(lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(service, s), INFERENCE_SERVICE)
    stop = asyncio.Event()
    http_ssl = None if config.tls is None else config.tls.ssl_context()
    guard = ConnectionGuard(config.header_timeout_s, config.max_connections_per_client)
    http = HttpServer(create_app(gateway, keys, limiter, is_serving=lambda: not stop.is_set()), http_ssl, guard)
    stats: LeasedRecord | None = None
    metrics: MetricsServer | None = None
    try:
        port = await server.start(config.host, config.port)
        frontend_id = f"frontend-{socket.gethostname()}-{port}"
        if config.metrics_port is not None:
            loop = asyncio.get_running_loop()
            probes = Probes(
                ready=lambda: on_loop(loop, lambda: readiness(config, view, stop.is_set()), _LOOP_ANSWER_S),
                live=lambda: on_loop(loop, lambda: None, _LOOP_ANSWER_S),
            )
            metrics = MetricsServer.start(gateway.metrics.registry, config.host, config.metrics_port, probes)
            print(f"pdserve frontend metrics on http://{config.host}:{metrics.port}/metrics", flush=True)
        # In the stats record, so that `pdserve top` finds the counters (migrations) to scrape.
        metrics_endpoint = None if metrics is None else f"{_advertised(config.host)}:{metrics.port}"
        stats = LeasedRecord(
            etcd,
            frontend_key(frontend_id),
            lambda: gateway.stats(frontend_id, metrics_endpoint).encode(),
            name=frontend_id,
            start_timeout_s=5.0,
        )
        await stats.start()
        http_note = ""
        if config.http_port is not None:
            http_port = await http.start(config.host, config.http_port)
            http_note = f"; OpenAI API on {http.scheme}://{_url_host(config.host)}:{http_port}/v1"
        keys_note = f" ({len(config.api_keys)} API keys)" if keys.required else ""
        print(f"pdserve frontend listening on {config.host}:{port}{http_note}{keys_note}", flush=True)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        install_stack_dump(loop, "frontend")
        await stop.wait()
        await server.set_serving(False)
    finally:
        await http.stop()
        await server.stop(grace_s=5.0)
        if stats is not None:
            await stats.close()
        await gateway.close()
        await view.close()
        await etcd.close()
        if metrics is not None:
            metrics.close()


def readiness(config: FrontendConfig, view: RegistryView, stopping: bool) -> str | None:
    """Why the frontend cannot serve a request now, None when it can: stopping, or no model has
    a worker (not draining) of every pool the router needs: decode always, prefill too when
    disaggregation is ``always`` (otherwise the decode worker computes prompts itself)."""
    if stopping:
        return "stopping"
    needed = [Role.DECODE, Role.PREFILL] if config.router.disaggregation == "always" else [Role.DECODE]
    serving: dict[Role, set[str]] = {role: set() for role in needed}
    for worker in view.workers():
        if worker.role in serving and not worker.draining:
            serving[worker.role].add(worker.model)
    if set.intersection(*serving.values()):
        return None
    missing = [str(role) for role in needed if not serving[role]]
    if missing:
        return f"no serving {' or '.join(missing)} worker"
    return "no model has a serving worker of every pool"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _advertised(host: str) -> str:
    """Where others reach a port bound on ``host``: the hostname for a wildcard, as a worker advertises."""
    return _url_host(socket.gethostname() if host in ("0.0.0.0", "::", "") else host)
