"""Stopping background tasks for certain, even when a cancellation is swallowed."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

from pdserve.lifecycle import cancel_and_wait
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
