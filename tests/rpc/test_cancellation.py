"""CancellationGuard on a real RpcServer: a handler cut from inside (a call it awaited, whose
channel was closed) answers INTERNAL at once; a client's own cancellation still cancels it."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.rpc.server import RpcServer
from tests.utils.aio import run_scenario

CALL_TIMEOUT_S = 30.0  # far beyond what a test waits: a call that hangs shows as a slow test


def _serve(server: RpcServer, service: str, methods: dict[str, grpc.RpcMethodHandler]) -> None:
    handlers = (grpc.method_handlers_generic_handler(service, methods),)
    server.add(lambda s: s.add_generic_rpc_handlers(handlers), service)


class _Servers:
    """A stalling backend, and a front server whose handlers await the backend over a channel
    the test can close (as the frontend closes the channel of a worker that left)."""

    def __init__(self) -> None:
        self.front = RpcServer()
        self.backend = RpcServer()
        self.channel: grpc.aio.Channel | None = None
        self.awaiting = asyncio.Event()  # a front handler awaits the backend
        self.ended: list[str] = []  # how each front handler ended

    async def start(self) -> grpc.aio.Channel:
        async def stall(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            await asyncio.Event().wait()
            return request

        async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                return await self._backend_call()
            finally:
                self.ended.append("unary")

        async def streaming(request: bytes, context: grpc.aio.ServicerContext):
            try:
                yield b"first"
                yield await self._backend_call()
            finally:
                self.ended.append("stream")

        _serve(self.backend, "test.Backend", {"Stall": grpc.unary_unary_rpc_method_handler(stall)})
        _serve(
            self.front,
            "test.Front",
            {
                "Unary": grpc.unary_unary_rpc_method_handler(unary),
                "Stream": grpc.unary_stream_rpc_method_handler(streaming),
            },
        )
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{await self.backend.start('127.0.0.1', 0)}")
        return grpc.aio.insecure_channel(f"127.0.0.1:{await self.front.start('127.0.0.1', 0)}")

    async def _backend_call(self) -> bytes:
        assert self.channel is not None
        call = self.channel.unary_unary("/test.Backend/Stall")(b"", timeout=CALL_TIMEOUT_S)
        self.awaiting.set()
        return await call

    async def cut(self) -> None:
        """Close the backend channel under the awaiting handler."""
        await asyncio.wait_for(self.awaiting.wait(), 10)
        assert self.channel is not None
        await self.channel.close(grace=None)

    async def stop(self) -> None:
        await self.front.stop(0)
        await self.backend.stop(0)


@pytest.mark.parametrize("kind", ["unary", "stream"])
def test_a_handler_cut_from_inside_answers_internal_at_once(kind: str) -> None:
    async def scenario() -> tuple[grpc.StatusCode, str, float, list[bytes]]:
        servers = _Servers()
        channel = await servers.start()
        received: list[bytes] = []
        started = time.monotonic()
        try:
            if kind == "unary":
                call = asyncio.ensure_future(channel.unary_unary("/test.Front/Unary")(b"", timeout=CALL_TIMEOUT_S))
            else:

                async def stream() -> None:
                    async for message in channel.unary_stream("/test.Front/Stream")(b"", timeout=CALL_TIMEOUT_S):
                        received.append(message)

                call = asyncio.ensure_future(stream())
            await servers.cut()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call
            return failed.value.code(), failed.value.details(), time.monotonic() - started, received
        finally:
            await channel.close()
            await servers.stop()

    code, details, took, received = run_scenario(scenario(), timeout_s=60)
    assert code == grpc.StatusCode.INTERNAL and took < 5.0
    method = "/test.Front/Unary" if kind == "unary" else "/test.Front/Stream"
    assert details == f"{method} was cut short: a call it awaited was cancelled"
    assert received == ([] if kind == "unary" else [b"first"])


def test_a_client_that_cancels_still_cancels_the_handler() -> None:
    async def scenario() -> list[str]:
        servers = _Servers()
        channel = await servers.start()
        try:
            call = channel.unary_stream("/test.Front/Stream")(b"", timeout=CALL_TIMEOUT_S)
            assert await call.read() == b"first"
            await asyncio.wait_for(servers.awaiting.wait(), 10)
            call.cancel()
            deadline = time.monotonic() + 5
            while not servers.ended and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return servers.ended
        finally:
            await channel.close()
            await servers.stop()

    assert run_scenario(scenario(), timeout_s=60) == ["stream"]  # its clean-up ran at once
