"""The metrics port's HTTP server: ``/metrics`` as prometheus_client serves it, and the
Kubernetes probes ``/readyz`` and ``/livez`` beside it.

Each probe is a check the process owns: a callable that returns None when healthy, else a
one-line reason. The server answers 200 ``ok`` or 503 with the reason, as text. A check runs on
the server's thread, so it must only read state that is safe to read there, or hop onto the
owner's event loop with ``on_loop``. A process without probes serves ``/metrics`` alone, on
every path (prometheus_client's behaviour). Imports nothing of pdserve.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

# None: healthy; otherwise why not, in one line.
Check = Callable[[], str | None]


@dataclass(frozen=True)
class Probes:
    """``ready``: may this process be sent work (``/readyz``); ``live``: is it making progress,
    or should it be restarted (``/livez``)."""

    ready: Check
    live: Check


class MetricsServer:
    """``/metrics`` of ``registry`` (and ``probes``' endpoints) on a daemon thread until ``close()``."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, probes: Probes | None = None) -> None:
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

        class _Server(ThreadingWSGIServer):
            address_family = family

        self._httpd = make_server(host, port, _app(registry, probes), _Server, handler_class=_QuietHandler)
        self.port: int = self._httpd.server_port
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="pdserve-metrics", daemon=True)

    @classmethod
    def start(cls, registry: CollectorRegistry, host: str, port: int, probes: Probes | None = None) -> MetricsServer:
        server = cls(registry, host, port, probes)
        server._thread.start()
        return server

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def on_loop(loop: asyncio.AbstractEventLoop, check: Check, timeout_s: float) -> str | None:
    """``check()`` run on ``loop``'s thread, where the state it reads lives: its verdict, or why
    not, when the loop does not answer within ``timeout_s`` (blocked, or closed)."""
    answer: concurrent.futures.Future[str | None] = concurrent.futures.Future()

    def run() -> None:
        try:
            answer.set_result(check())
        except Exception as exc:  # the verdict, not the loop's problem
            answer.set_exception(exc)

    try:
        loop.call_soon_threadsafe(run)
    except RuntimeError:
        return "event loop closed"
    try:
        return answer.result(timeout_s)
    except TimeoutError:
        return f"event loop did not answer within {timeout_s:g}s"


def _app(registry: CollectorRegistry, probes: Probes | None) -> Callable[..., Iterable[bytes]]:
    metrics = make_wsgi_app(registry)
    checks = {} if probes is None else {"/readyz": probes.ready, "/livez": probes.live}

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        check = checks.get(environ.get("PATH_INFO", ""))
        if check is None:
            return metrics(environ, start_response)
        try:
            reason = check()
        except Exception as exc:  # a check that cannot tell is a failed one
            reason = f"check failed: {exc!r}"
        body = f"{'ok' if reason is None else reason}\n".encode()
        status = "200 OK" if reason is None else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
        return [body]

    return app


class _QuietHandler(WSGIRequestHandler):
    """No access log: probes and scrapes come every few seconds."""

    def log_message(self, format: str, *args: Any) -> None:
        pass
