"""One gRPC channel per worker endpoint, opened when the worker joins (or on first use),
closed when it leaves; over mTLS with the cluster's certificate set when the cluster has one.

Closing a channel cancels the calls still on it, and gRPC tells their callers so by raising
``asyncio.CancelledError`` in them, as if their own task had been cancelled. Left alone, that
error would end a client's stream with no status at all (grpc.aio sends none for a cancelled
handler), and the client would wait for its deadline. Code awaiting a worker's call does so
inside ``unavailable_if_closed``, which turns it into the UNAVAILABLE it is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from typing import Any

import grpc

from pdserve.rpc.server import CHANNEL_OPTIONS
from pdserve.rpc.tls import ClientTLS, secure_or_insecure_channel
from pdserve.v1 import worker_pb2_grpc


class WorkerChannels:
    """Attributes:
    tls: the client side of the cluster's certificate set (``ClusterTLS.client``), or None for
        plaintext.
    """

    def __init__(self, tls: ClientTLS | None = None) -> None:
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        # Background work (closing channels, releasing pins) is owned here: the event loop keeps
        # only weak references to tasks, and close_all waits for it.
        self._tasks: set[asyncio.Task[None]] = set()

    def stub(self, endpoint: str) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self._channel(endpoint))

    def connect(self, endpoint: str) -> None:
        """Start connecting to a worker now, without waiting: its first request then finds the
        connection (TCP, HTTP/2 and TLS when the cluster has certificates) made."""
        self._channel(endpoint).get_state(try_to_connect=True)

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = secure_or_insecure_channel(endpoint, self.tls, CHANNEL_OPTIONS)
        return channel

    def close(self, endpoint: str) -> None:
        """Close the worker's channel (in the background: in-flight calls on it fail)."""
        channel = self._channels.pop(endpoint, None)
        if channel is not None:
            self.in_background(channel.close(grace=1.0))

    def in_background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` without waiting for it; ``close_all`` does."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close_all(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close(grace=None) for c in channels), return_exceptions=True)


class LeftRegistry(grpc.aio.AioRpcError):
    """UNAVAILABLE: a call cut because its worker left the registry. That says nothing of the
    worker itself: a registry that lost its data (etcd restarted empty) drops every worker at
    once, and they register again under the same ids."""


@contextlib.contextmanager
def unavailable_if_closed(endpoint: str) -> Iterator[None]:
    """Raise ``LeftRegistry`` where a call to ``endpoint`` raised ``CancelledError`` without the
    awaiting task being cancelled: its channel was closed, because the worker left the
    registry. A real cancellation goes through as it is."""
    try:
        yield
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise
        empty = grpc.aio.Metadata()
        details = f"the channel to {endpoint} was closed: the worker left the registry"
        raise LeftRegistry(grpc.StatusCode.UNAVAILABLE, empty, empty, details) from None
