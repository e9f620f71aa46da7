"""A worker's side of live knobs: poll the model's knobs and apply each change.

Polling rather than a watch: a poll is one bounded call that cannot hang, and a change
taking a second to land is well inside the planner's interval. A worker that already runs a
``RegistryView`` (a decode worker) reads the knobs that the view's own poll brings
(``from_view``); any other reads the model's key itself about once a second (``from_etcd``).
While etcd is away the worker keeps the knobs it has (logged once).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pdserve.discovery.etcd import MAX_CALL_TIMEOUT_S, EtcdConnection
from pdserve.discovery.knobs import Knobs, get_knobs
from pdserve.discovery.registry_view import RegistryView
from pdserve.discovery.retry import UNAVAILABLE, Outage
from pdserve.lifecycle import cancel_and_wait

logger = logging.getLogger(__name__)


class KnobsFollower:
    """Calls ``apply(knobs)`` with the model's stored knobs whenever they change (None when
    they are deleted: back to start-up settings). ``read()`` gives the stored knobs, raises
    ValueError for a value that does not decode (the current knobs stay) and one of
    ``retry.UNAVAILABLE`` while etcd is away. A failing ``apply`` is logged and retried at
    the next change; nothing escapes the background task."""

    def __init__(
        self,
        read: Callable[[], Awaitable[Knobs | None]],
        model: str,
        apply: Callable[[Knobs | None], Awaitable[None]],
        *,
        poll_s: float = 1.0,
    ) -> None:
        self.model = model
        self._read = read
        self._apply = apply
        self._poll_s = poll_s
        self._applied: Knobs | None = None
        self._outage = Outage(logger)
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def from_etcd(
        cls,
        etcd: EtcdConnection,
        model: str,
        apply: Callable[[Knobs | None], Awaitable[None]],
        *,
        poll_s: float = 1.0,
    ) -> KnobsFollower:
        """A follower that reads the model's key through ``etcd`` every ``poll_s``."""
        timeout_s = min(MAX_CALL_TIMEOUT_S, max(poll_s, 0.5))

        async def read() -> Knobs | None:
            async with etcd.use() as client:
                return await get_knobs(client, model, timeout_s)

        return cls(read, model, apply, poll_s=poll_s)

    @classmethod
    def from_view(
        cls, view: RegistryView, model: str, apply: Callable[[Knobs | None], Awaitable[None]]
    ) -> KnobsFollower:
        """A follower that takes the model's knobs from ``view``, as often as the view polls etcd."""

        async def read() -> Knobs | None:
            return view.knobs(model)

        return cls(read, model, apply, poll_s=view.poll_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._follow(), name=f"knobs of {self.model}")

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def poll(self) -> None:
        """Read the knobs once and apply them if they changed."""
        try:
            knobs = await self._read()
        except UNAVAILABLE as exc:
            self._outage.failed(exc, "knobs of %s: etcd unreachable, keeping the current ones", self.model)
            return
        except ValueError as exc:  # a bad value: keep what works
            logger.warning("knobs of %s: %s; keeping the current ones", self.model, exc)
            return
        self._outage.answered()
        if knobs == self._applied:
            return
        self._applied = knobs  # a failure is not retried until the knobs change again
        try:
            await self._apply(knobs)
        except Exception:
            logger.exception("knobs of %s: could not apply %s", self.model, knobs)

    async def _follow(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self._poll_s)
