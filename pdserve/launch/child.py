"""One child process of ``pdserve up``: a ``python -m pdserve ...`` server, started (again) and
stopped.

A child is ready when it prints its "listening on" line; one that exits or stays silent past
the start-up deadline fails the start with its last output. Its output is forwarded, each line
prefixed with its name. A ``Child`` is a slot that outlives its processes: after a crash the
supervisor calls ``start`` again and the same object holds the new process.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import signal
import sys
from dataclasses import dataclass, field

from pdserve.environment import PARENT_PID
from pdserve.lifecycle import DUMP_SIGNAL, cancel_and_wait

logger = logging.getLogger(__name__)

_READY = "listening on "
# How long a child that did not stop gets to print its stacks before it is killed.
_DUMP_WAIT_S = 2.0


class ChildFailed(RuntimeError):
    """A child process exited or never became ready."""


@dataclass
class Child:
    """Attributes:
    name: what logs and metrics call it (``decode-2``, ``frontend``).
    role: its kind, a metrics label (``prefill``, ``decode``, ``frontend``).
    argv: the ``pdserve`` command line it runs.
    process: the process now (or last) running.
    address: the address its last start printed after "listening on".
    http_url: the OpenAI API base URL it printed on that line (a frontend's), else "".
    output: its last lines, for an error report.
    num_starts: how many times it became ready (a restart that listened counts).
    """

    name: str
    role: str
    argv: list[str]
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 60.0
    process: asyncio.subprocess.Process | None = None
    address: str = ""
    http_url: str = ""
    num_starts: int = 0
    output: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=20))
    reader: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Start the process (again) and wait until it listens; returns its address.

        Raises ChildFailed, with its last output, when it exits first or is silent past
        ``start_timeout_s``; the process is stopped then, and when the start is cancelled.
        """
        await self._reap()
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "pdserve",
            *self.argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, PARENT_PID: str(os.getpid())},  # a killed `up` takes its children with it
        )
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[str] = loop.create_future()
        self.reader = loop.create_task(self._read(self.process, ready), name=f"output of {self.name}")
        try:
            async with asyncio.timeout(self.start_timeout_s):
                rest = await ready  # "HOST:PORT[; OpenAI API on URL][ (N API keys)]"
            self.address = rest.split()[0].rstrip(";")
            found = re.search(r"https?://\S+", rest)
            self.http_url = found.group(0) if found else ""
            self.num_starts += 1
        except (TimeoutError, ChildFailed) as exc:
            await self.stop()
            last = "\n  ".join(self.output) or "(no output)"
            why = "did not start in time" if isinstance(exc, TimeoutError) else "exited"
            raise ChildFailed(f"{self.name} {why}; its last output:\n  {last}") from None
        except BaseException:
            await self.stop()
            raise
        return self.address

    async def wait(self) -> int:
        """Until the process exits; its exit status (negative: the signal that killed it)."""
        assert self.process is not None
        return await self.process.wait()

    @property
    def is_alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def _read(self, process: asyncio.subprocess.Process, ready: asyncio.Future[str]) -> None:
        """Forward the process's output (prefixed) and resolve ``ready`` at its listening line."""
        assert process.stdout is not None
        async for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.output.append(line)
            print(f"[{self.name}] {line}", file=sys.stderr, flush=True)
            if not ready.done() and _READY in line:
                ready.set_result(line.split(_READY, 1)[1].strip())
        if not ready.done():
            ready.set_exception(ChildFailed(self.name))

    async def _reap(self) -> None:
        """After the last process died: kill what it left in its process group (nothing must
        outlive it and hold its output open), and read that output to its end."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        if self.reader is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_DUMP_WAIT_S):
                    await asyncio.gather(self.reader, return_exceptions=True)
            await cancel_and_wait(self.reader)
            self.reader = None

    async def stop(self) -> None:
        """SIGTERM (the child drains), then SIGKILL after ``stop_timeout_s``."""
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(self.stop_timeout_s):
                    await process.wait()
            except TimeoutError:
                logger.warning(
                    "%s did not stop in %.0fs: dumping its stacks, then killing it", self.name, self.stop_timeout_s
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, DUMP_SIGNAL)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_DUMP_WAIT_S):
                        await process.wait()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        await self._reap()
