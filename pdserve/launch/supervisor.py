"""Keeping ``pdserve up``'s children alive: restart what dies, with back-off, up to a limit.

Each supervised child has a task that waits for it to exit. A child that exits on its own is
restarted after a back-off that doubles with each crash in a row (``RestartPolicy``); one that
stayed up ``reset_after_s`` starts its count afresh. A start that fails counts as a crash. Past
``max_restarts`` crashes in a row the supervisor gives up on it and tells its owner. Restarts
and give-ups are logged and counted (``SupervisorMetrics``). Stopping a child on purpose
(scaling down, shutting down) first ``release``s it, so that its exit is not a crash.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pdserve.launch.child import ChildFailed
from pdserve.lifecycle import cancel_and_wait
from pdserve.observability.metrics import SupervisorMetrics

logger = logging.getLogger(__name__)

MAX_RESTARTS = 5


@dataclass(frozen=True)
class RestartPolicy:
    """Attributes:
    max_restarts: restarts in a row before giving up on a child (0: never restart).
    min_backoff_s: the wait before the first restart; it doubles with each crash in a row.
    max_backoff_s: the longest wait.
    reset_after_s: a child up this long has its crash count reset when it dies.
    """

    max_restarts: int = MAX_RESTARTS
    min_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    reset_after_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not 0 <= self.min_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"need 0 <= min_backoff_s <= max_backoff_s, got {self.min_backoff_s} and {self.max_backoff_s}"
            )

    def backoff_s(self, num_crashes: int) -> float:
        """The wait before the restart that follows the ``num_crashes``-th crash in a row (1-based)."""
        return min(self.min_backoff_s * 2 ** (num_crashes - 1), self.max_backoff_s)


class Supervised(Protocol):
    """What the supervisor restarts: a child process, or the registry."""

    name: str
    role: str

    async def start(self) -> object:
        """Start it (again); raises ChildFailed when it does not come up."""

    async def wait(self) -> int:
        """Until it exits; its exit status."""


def describe_exit(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


class Supervisor:
    """Restarts the children it watches; ``on_give_up(child, why)`` is called for one it gave up
    on, and ``is_done(child, code)`` says whether an exit was the child's last word (a worker
    that drained on request) rather than a crash; the owner then drops it.
    """

    def __init__(
        self,
        policy: RestartPolicy,
        metrics: SupervisorMetrics,
        on_give_up: Callable[[Supervised, str], None],
        is_done: Callable[[Supervised, int], bool] = lambda child, code: False,
    ) -> None:
        self.policy = policy
        self.metrics = metrics
        self._on_give_up = on_give_up
        self._is_done = is_done
        self._tasks: dict[int, asyncio.Task[None]] = {}  # by id(child)

    def watch(self, child: Supervised) -> None:
        """Supervise ``child``, which runs now."""
        self._tasks[id(child)] = asyncio.get_running_loop().create_task(
            self._supervise(child), name=f"supervising {child.name}"
        )

    async def release(self, child: Supervised) -> None:
        """Stop supervising ``child`` (a restart under way is cancelled, its process stopped)."""
        task = self._tasks.pop(id(child), None)
        if task is not None:
            await cancel_and_wait(task)

    async def close(self) -> None:
        """Release every child."""
        tasks, self._tasks = list(self._tasks.values()), {}
        await asyncio.gather(*(cancel_and_wait(t) for t in tasks))

    async def _supervise(self, child: Supervised) -> None:
        num_crashes = 0
        while True:
            up_since = time.monotonic()
            code = await child.wait()
            if self._is_done(child, code):
                logger.info("%s %s; not restarting it", child.name, describe_exit(code))
                self._on_give_up(child, describe_exit(code))
                return
            if time.monotonic() - up_since >= self.policy.reset_after_s:
                num_crashes = 0
            why = describe_exit(code)
            while True:
                num_crashes += 1
                self.metrics.crashed(child.name, child.role)
                if num_crashes > self.policy.max_restarts:
                    logger.error(
                        "%s %s; giving up on it after %d restarts in a row (--max-restarts %d)",
                        child.name,
                        why,
                        num_crashes - 1,
                        self.policy.max_restarts,
                    )
                    self.metrics.gave_up(child.name, child.role)
                    self._on_give_up(child, why)
                    return
                delay = self.policy.backoff_s(num_crashes)
                logger.warning(
                    "%s %s; restarting it in %.1f s (restart %d of at most %d in a row)",
                    child.name,
                    why,
                    delay,
                    num_crashes,
                    self.policy.max_restarts,
                )
                await asyncio.sleep(delay)
                self.metrics.restarted(child.name, child.role)
                try:
                    await child.start()
                except ChildFailed as exc:
                    why = f"did not start again: {exc}"
                    continue
                logger.warning(
                    "%s is back after %d restart%s in a row", child.name, num_crashes, "" if num_crashes == 1 else "s"
                )
                break
