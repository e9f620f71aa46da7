"""One gRPC channel per worker endpoint, opened on first use, closed when the worker leaves."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.rpc.server import CHANNEL_OPTIONS
from pdserve.v1 import worker_pb2_grpc


class WorkerChannels:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, endpoint: str) -> worker_pb2_grpc.WorkerStub:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        return worker_pb2_grpc.WorkerStub(channel)

    def close(self, endpoint: str) -> None:
        """Close the worker's channel (in the background: in-flight calls on it fail)."""
        channel = self._channels.pop(endpoint, None)
        if channel is not None:
            asyncio.get_running_loop().create_task(channel.close(grace=1.0))

    async def close_all(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close(grace=None) for c in channels), return_exceptions=True)
