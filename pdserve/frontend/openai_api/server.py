"""The HTTP server: uvicorn, run programmatically on the frontend's own event loop beside grpc.aio.

The frontend process owns its signals (SIGTERM drains it), so uvicorn's own signal handling is
turned off; ``stop`` asks it to finish, giving streams in flight the grace period. The socket is
bound here, so port 0 picks a free port that ``start`` returns. ``ssl`` (an ``ssl.SSLContext``)
serves HTTPS with whatever certificates and client checks the context holds. ``guard`` (a
``ConnectionGuard``) bounds the time each request's headers take and the connections one client
address holds open.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl as ssl_module
from collections.abc import Generator
from typing import cast

import anyio
import uvicorn
from starlette.types import ASGIApp

from pdserve.frontend.openai_api.connection_guard import ConnectionGuard


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the process's own handlers stay: the frontend stops this server itself


class HttpServer:
    def __init__(
        self, app: ASGIApp, ssl: ssl_module.SSLContext | None = None, guard: ConnectionGuard | None = None
    ) -> None:
        self.app = app
        self.ssl = ssl
        self.guard = guard
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.ssl is not None else "http"

    async def start(self, host: str, port: int, grace_s: float = 5.0) -> int:
        """Listen on ``host:port`` (0: a free port) and serve; returns the bound port."""
        sock = socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, reuse_port=False
        )
        self.port = sock.getsockname()[1]
        context = self.ssl
        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="off",
            # uvicorn calls its ``http`` class with keywords for each connection: the guard's factory does as well.
            http="auto" if self.guard is None else cast("type[asyncio.Protocol]", self.guard.protocol),
            timeout_graceful_shutdown=int(max(grace_s, 1)),
            ssl_context_factory=(lambda _config, _default: context) if context is not None else None,
        )
        self._server = _Server(config)
        # anyio imports its asyncio backend when first asked for it, which would be inside the
        # first request (starlette's task groups): ~25 ms of that request's TTFT. Ask now.
        anyio.get_cancelled_exc_class()
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]), name="http")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError(f"the HTTP server on {host}:{port} stopped during start-up")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        """Stop accepting, let responses in flight finish (the grace period), then return."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
        self._server = self._task = None
