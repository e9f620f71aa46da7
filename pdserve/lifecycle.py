"""A server process's life: what it is waiting on when asked, dying with the parent that ran
it, and stopping its background tasks for certain.

``kill -USR1 PID`` prints every asyncio task and thread of a pdserve server. A server stuck
in its event loop shows, to a thread-level tool, only a loop idling in ``select``; the task
stacks say which ``await`` never returns. ``pdserve up`` sends SIGUSR1 to a child that does
not stop in time, before killing it, so the answer lands in its log.

A child that ``pdserve up`` starts sets ``$PDSERVE_PARENT_PID``; such a child asks the kernel to
kill it when that parent dies (Linux), so killing ``up`` with SIGKILL leaves no worker behind.

Background loops are stopped with ``cancel_and_wait``, never a bare ``cancel()`` and
``await``: on Python 3.11, ``asyncio.wait_for`` swallows a cancellation that arrives just as
the call it waits on completes (CPython issue 86296, fixed in 3.12), and the loop around it
then runs on, so whoever awaits it waits forever. A worker that took minutes to exit on
SIGTERM, and a test that hung for 600 s in CI, were this. pdserve's own deadlines therefore
use ``asyncio.timeout``, which runs the call in the waiting task itself and cannot lose a
cancellation; ``cancel_and_wait`` still guards against any library call that might.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import io
import linecache
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterable

from pdserve import environment

logger = logging.getLogger(__name__)

DUMP_SIGNAL = signal.SIGUSR1
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# Where a coroutine, generator or async generator keeps its frame, and what it awaits.
_FRAME_ATTRS = ("cr_frame", "gi_frame", "ag_frame")
_AWAIT_ATTRS = ("cr_await", "gi_yieldfrom", "ag_await")
_MAX_AWAIT_DEPTH = 100  # a bound, should a chain ever loop


def install_stack_dump(loop: asyncio.AbstractEventLoop, name: str) -> None:
    """Dump the stacks of ``loop``'s tasks and of every thread to stderr on SIGUSR1."""
    loop.add_signal_handler(DUMP_SIGNAL, lambda: print(stack_dump(loop, name), file=sys.stderr, flush=True))


def stack_dump(loop: asyncio.AbstractEventLoop, name: str) -> str:
    """Every pending task of ``loop``, down the chain of what it awaits, and every thread,
    innermost frame last."""
    out = io.StringIO()
    tasks = asyncio.all_tasks(loop)
    out.write(f"--- {name}: {len(tasks)} asyncio tasks ---\n")
    out.write(task_stacks(tasks))
    frames = sys._current_frames()
    out.write(f"--- {name}: {len(frames)} threads ---\n")
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in frames.items():
        out.write(f"thread {names.get(ident, ident)}:\n")
        out.write("".join(traceback.format_stack(frame)))
    out.write(f"--- {name}: end ---")
    return out.getvalue()


def task_stacks(tasks: Iterable[asyncio.Task]) -> str:
    """Each task by name, with the chain of awaits it is suspended in, innermost last."""
    return "".join(
        f"task {task.get_name()}:\n{_await_chain(task.get_coro())}"
        for task in sorted(tasks, key=lambda t: t.get_name())
    )


def _await_chain(awaitable: object) -> str:
    """Where a task waits: its coroutine's frame, then the frame of each coroutine or
    generator it awaits, down to the innermost, and the future that one awaits.

    ``Task.print_stack`` shows only the outermost frame, and raises on the Cython coroutines
    gRPC runs its handlers in (their frames have no line number).
    """
    lines = []
    for _ in range(_MAX_AWAIT_DEPTH):
        frame = next((f for attr in _FRAME_ATTRS if (f := getattr(awaitable, attr, None)) is not None), None)
        if frame is None:
            break
        code, lineno = frame.f_code, frame.f_lineno
        lines.append(f'  File "{code.co_filename}", line {lineno or "?"}, in {code.co_name}\n')
        source = linecache.getline(code.co_filename, lineno).strip() if lineno else ""
        if source:
            lines.append(f"    {source}\n")
        awaitable = _awaited(awaitable)
    if awaitable is not None:
        lines.append(f"  awaiting {awaitable!r}\n")
    return "".join(lines)


def _awaited(awaitable: object) -> object | None:
    """What ``awaitable`` waits on now. A coroutine awaited from Cython code is seen through
    its ``__await__`` wrapper, which names the coroutine to the garbage collector only."""
    awaited = next((a for attr in _AWAIT_ATTRS if (a := getattr(awaitable, attr, None)) is not None), None)
    if awaited is not None and type(awaited).__name__ == "coroutine_wrapper":
        return next((r for r in gc.get_referents(awaited) if hasattr(r, "cr_frame")), awaited)
    return awaited


def die_with_parent() -> None:
    """If ``$PDSERVE_PARENT_PID`` names this process's parent, be SIGKILLed when that parent dies.

    A no-op without the variable and off Linux. The parent may already be gone by the time
    this runs; the pid check afterwards catches that.
    """
    expected = environment.parent_pid()
    if not expected or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # best effort: without it the child outlives a killed parent, as any process would
    if str(os.getppid()) != expected:
        os.kill(os.getpid(), signal.SIGKILL)


async def cancel_and_wait(task: asyncio.Task, *, retry_s: float = 0.5) -> None:
    """Cancel ``task`` and return once it has ended, cancelling again every ``retry_s`` until
    it does (a cancellation may be swallowed; see the module's docstring). An exception it
    ended with is logged, not raised: the caller is shutting it down."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=retry_s)
    if not task.cancelled() and task.exception() is not None:
        logger.warning("task %s ended with %r", task.get_name(), task.exception())
