"""Worker channels: a joining worker's connection is made before any request needs it."""

from __future__ import annotations

import asyncio
import time

import grpc

from pdserve.frontend.channels import WorkerChannels


def test_connect_opens_the_connection_without_a_call():
    async def scenario() -> grpc.ChannelConnectivity:
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channels = WorkerChannels()
        try:
            endpoint = f"127.0.0.1:{port}"
            channels.connect(endpoint)
            channel = channels._channel(endpoint)
            deadline = time.monotonic() + 10.0
            while channel.get_state() is not grpc.ChannelConnectivity.READY and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return channel.get_state()
        finally:
            await channels.close_all()
            await server.stop(None)

    assert asyncio.run(scenario()) is grpc.ChannelConnectivity.READY
