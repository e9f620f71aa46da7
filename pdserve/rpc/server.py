"""A grpc.aio server with pdserve's standard extras: health checking and reflection."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.rpc.cancellation import CancellationGuard
from pdserve.rpc.tls import ServerTLS

# Tokens and text deltas are small; a prompt of token ids can be large.
MAX_MESSAGE_BYTES = 64 * 2**20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class RpcServer:
    """Owns a grpc.aio server, its health service and reflection.

    ``add(register, service_name)`` registers a servicer (e.g.
    ``lambda s: add_InferenceServicer_to_server(servicer, s)``) under its full service name,
    which is also what health and reflection report. With ``tls`` it serves TLS only (and
    with its ``client_ca``, only to clients presenting a certificate that CA signed);
    ``interceptors`` see every call first (the frontend's API-key check, a worker's ``AdminGuard``).
    Every server also has a ``CancellationGuard``: no handler ends without a status.
    """

    def __init__(self, tls: ServerTLS | None = None, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> None:
        self.tls = tls
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=[*interceptors, CancellationGuard()])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._services: list[str] = []
        self.port: int | None = None

    def add(self, register: Callable[[grpc.aio.Server], None], service_name: str) -> None:
        register(self.server)
        self._services.append(service_name)

    async def start(self, host: str, port: int) -> int:
        """Bind ``host:port`` (0 picks a free port), start serving, return the bound port.

        A TLS file that is missing or does not match is a ValueError naming it.
        """
        address = f"{host}:{port}"
        if self.tls is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, self.tls.grpc_credentials())
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        names = [*self._services, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        await self.server.start()
        await self.set_serving(True)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING (draining) for the server and each service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self._services]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)
