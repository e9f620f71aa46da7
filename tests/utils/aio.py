"""Running a test's asyncio scenario under a deadline that explains itself when it passes, and
waiting in one for a condition."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from pdserve.lifecycle import task_stacks

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 120.0


def run_scenario(scenario: Coroutine[Any, Any, T], timeout_s: float = DEFAULT_TIMEOUT_S) -> T:
    """``asyncio.run(scenario)``, failing after ``timeout_s`` with the stack of every pending task.

    pytest-timeout's own report shows only threads, and an asyncio hang shows there as the
    event loop idling in ``select``; the task stacks say which await never returned.
    """

    async def guarded() -> T:
        task = asyncio.ensure_future(scenario)
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if task in done:
            return task.result()
        stacks = task_stacks(t for t in asyncio.all_tasks() if t is not asyncio.current_task())
        # Printed before cancelling: should a task ignore the cancel, asyncio.run's clean-up
        # would hang, and pytest-timeout's report still shows what was captured.
        print(stacks, file=sys.stderr, flush=True)
        task.cancel()
        raise AssertionError(f"the scenario did not finish within {timeout_s:g} s; pending tasks:\n{stacks}")

    return asyncio.run(guarded())


async def eventually(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Return once ``predicate()`` holds; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.02)
