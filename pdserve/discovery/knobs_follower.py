"""A worker's side of live knobs: poll the model's knobs in etcd and apply each change.

Polling once a second, like the registration's refresh, rather than a watch: a poll is one
bounded call that cannot hang, and a change taking a second to land is well inside the
planner's interval. While etcd is away the worker keeps the knobs it has (logged once).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pdserve.discovery.etcd import ETCD_ERRORS, MAX_CALL_TIMEOUT_S, EtcdConnection, RegistryUnavailable
from pdserve.discovery.knobs import Knobs, get_knobs
from pdserve.lifecycle import cancel_and_wait

logger = logging.getLogger(__name__)


class KnobsFollower:
    """Calls ``apply(knobs)`` with the model's stored knobs whenever they change (None when
    they are deleted: back to start-up settings). A failing ``apply`` is logged and retried at
    the next change; nothing escapes the background task."""

    def __init__(
        self,
        etcd_url: str,
        model: str,
        apply: Callable[[Knobs | None], Awaitable[None]],
        *,
        poll_s: float = 1.0,
    ) -> None:
        self.model = model
        self._apply = apply
        self._poll_s = poll_s
        self._etcd = EtcdConnection(etcd_url, min(MAX_CALL_TIMEOUT_S, max(poll_s, 0.5)))
        self._applied: Knobs | None = None
        self._reachable = True
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._follow(), name=f"knobs of {self.model}")

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        await self._etcd.reset()

    async def poll(self) -> None:
        """Read the knobs once and apply them if they changed."""
        try:
            client = await self._etcd.client()
            knobs = await get_knobs(client, self.model, self._etcd.timeout_s)
        except (*ETCD_ERRORS, RegistryUnavailable) as exc:
            if self._reachable:
                logger.warning("knobs of %s: etcd unreachable, keeping the current ones: %s", self.model, exc)
            self._reachable = False
            await self._etcd.reset()
            return
        except ValueError as exc:  # a bad value: keep what works
            logger.warning("knobs of %s: %s; keeping the current ones", self.model, exc)
            return
        self._reachable = True
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
