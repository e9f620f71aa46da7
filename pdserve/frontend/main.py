"""Run the frontend process: watch the registry, serve the public API until stopped."""

from __future__ import annotations

import asyncio
import signal
import socket

from pdserve.discovery.etcd import EtcdConnection
from pdserve.discovery.registration import LeasedRecord
from pdserve.discovery.registry import frontend_key
from pdserve.discovery.registry_view import RegistryView
from pdserve.frontend.config import FrontendConfig
from pdserve.frontend.service import INFERENCE_SERVICE, InferenceService
from pdserve.lifecycle import install_stack_dump
from pdserve.observability.metrics import serve_metrics
from pdserve.rpc.server import RpcServer
from pdserve.v1 import inference_pb2_grpc


async def serve(config: FrontendConfig) -> None:
    """Serve until SIGTERM or SIGINT; in-flight streams get a few seconds to finish."""
    etcd = EtcdConnection(config.etcd, auth=config.etcd_auth)  # the process's one client, closed last
    view = RegistryView(etcd)
    try:
        await view.start()
    except BaseException:
        await etcd.close()
        raise
    service = InferenceService(config, view)
    server = RpcServer(tls=config.tls)
    server.add(lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(service, s), INFERENCE_SERVICE)
    stats: LeasedRecord | None = None
    try:
        port = await server.start(config.host, config.port)
        frontend_id = f"frontend-{socket.gethostname()}-{port}"
        stats = LeasedRecord(
            etcd, frontend_key(frontend_id), lambda: service.stats(frontend_id).encode(),
            name=frontend_id, start_timeout_s=5.0,
        )  # fmt: skip
        await stats.start()
        if config.metrics_port is not None:
            metrics_port = serve_metrics(service.metrics.registry, config.host, config.metrics_port)
            print(f"pdserve frontend metrics on http://{config.host}:{metrics_port}/metrics", flush=True)
        print(f"pdserve frontend listening on {config.host}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        install_stack_dump(loop, "frontend")
        await stop.wait()
        await server.set_serving(False)
    finally:
        await server.stop(grace_s=5.0)
        if stats is not None:
            await stats.close()
        await service.close()
        await view.close()
        await etcd.close()
