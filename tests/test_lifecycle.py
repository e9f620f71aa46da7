"""Stopping background tasks for certain, even when a cancellation is swallowed; the stack
dump a stuck server prints."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import grpc
from grpc import aio

from pdserve.lifecycle import cancel_and_wait, stack_dump
from tests.utils.aio import run_scenario


async def _poller(entered: asyncio.Event) -> None:
    """A polling loop whose each poll is an ``asyncio.wait_for`` on a call that has completed."""
    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    while True:
        entered.set()
        await asyncio.wait_for(done, 10)
        await asyncio.sleep(0.05)


def test_cancel_and_wait_ends_a_loop_even_when_wait_for_swallows_the_cancellation() -> None:
    async def scenario() -> tuple[bool, float]:
        entered = asyncio.Event()
        task = asyncio.create_task(_poller(entered))
        await entered.wait()  # the poller is inside wait_for, its call already completed
        start = time.monotonic()
        await asyncio.wait_for(cancel_and_wait(task, retry_s=0.2), 5)
        return task.cancelled(), time.monotonic() - start

    cancelled, seconds = run_scenario(scenario(), timeout_s=30)
    assert cancelled and seconds < 2


def test_a_plain_cancel_can_be_swallowed_here_so_the_test_above_means_something() -> None:
    async def scenario() -> bool:
        entered = asyncio.Event()
        task = asyncio.create_task(_poller(entered))
        await entered.wait()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=0.5)
        await cancel_and_wait(task)
        return bool(done)

    ended_at_once = run_scenario(scenario(), timeout_s=30)
    # Python 3.11 swallows it (CPython issue 86296); 3.12 and later do not.
    assert ended_at_once == (sys.version_info >= (3, 12))


def test_an_exception_the_task_ended_with_is_logged_not_raised(caplog) -> None:
    async def failing() -> None:
        raise RuntimeError("boom")

    async def scenario() -> None:
        task = asyncio.create_task(failing(), name="failing loop")
        await asyncio.sleep(0)
        await cancel_and_wait(task)

    with caplog.at_level(logging.WARNING, logger="pdserve.lifecycle"):
        run_scenario(scenario())
    assert any("failing loop" in r.getMessage() and "boom" in r.getMessage() for r in caplog.records)


async def _stuck_deep_inside(entered: asyncio.Event) -> None:
    entered.set()
    await asyncio.Event().wait()


def test_the_stack_dump_follows_a_grpc_handler_down_to_the_await_it_is_stuck_in() -> None:
    """gRPC runs handlers in Cython coroutines, whose frames have no line number: the dump
    must get through them (``Task.print_stack`` raises there) to the handler's own frames."""

    async def scenario() -> str:
        entered = asyncio.Event()

        async def handler(request: bytes, context: aio.ServicerContext) -> bytes:
            await _stuck_deep_inside(entered)
            return request

        server = aio.server()
        methods = {"Call": grpc.unary_unary_rpc_method_handler(handler)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Stuck", methods),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = asyncio.ensure_future(channel.unary_unary("/test.Stuck/Call")(b"", timeout=30))
                await asyncio.wait_for(entered.wait(), 10)
                dump = stack_dump(asyncio.get_running_loop(), "stuck server")
                call.cancel()
        finally:
            await server.stop(0)
        return dump

    dump = run_scenario(scenario(), timeout_s=60)
    assert dump.startswith("--- stuck server:") and dump.endswith("--- stuck server: end ---")
    handler_task = dump[dump.index("task HandleExceptions[/test.Stuck/Call]") :]
    handler_task = handler_task[: handler_task.index("\ntask ")]
    # The handler's frames, innermost last, each with its line, then what the innermost awaits.
    assert handler_task.index("in handler\n") < handler_task.index("in _stuck_deep_inside\n")
    assert "await asyncio.Event().wait()" in handler_task
    assert "thread MainThread:" in dump
