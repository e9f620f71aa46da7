"""A worker's side of live knobs: follow the model's knobs and apply each change.

The knobs come by etcd watch, so a change lands within milliseconds. A worker that already
runs a ``RegistryView`` (a decode worker) takes the knobs that the view's own watch brings
(``from_view``); any other watches the model's key itself (``from_etcd``), through the
process's shared connection. While etcd is away the worker keeps the knobs it has.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pdserve.discovery.etcd import EtcdConnection
from pdserve.discovery.knobs import Knobs, decode_knobs
from pdserve.discovery.registry import knobs_key
from pdserve.discovery.registry_view import RegistryView
from pdserve.discovery.watch import Follower, WatchedRange
from pdserve.lifecycle import cancel_and_wait

logger = logging.getLogger(__name__)


class KnobsFollower:
    """Calls ``apply(knobs)`` with the model's stored knobs whenever they change (None when
    they are deleted: back to start-up settings). ``current()`` gives the stored knobs and
    raises ValueError for a value that does not decode (the applied knobs stay); the source
    calls ``changed()`` when they may have changed. A failing ``apply`` is logged and retried
    at the next change; nothing escapes the background task."""

    def __init__(
        self,
        current: Callable[[], Knobs | None],
        model: str,
        apply: Callable[[Knobs | None], Awaitable[None]],
        *,
        follower: Follower | None = None,
    ) -> None:
        self.model = model
        self._current = current
        self._apply = apply
        self._follower = follower  # the watch this follower owns, if any
        self._applied: Knobs | None = None
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def from_etcd(
        cls, etcd: EtcdConnection, model: str, apply: Callable[[Knobs | None], Awaitable[None]]
    ) -> KnobsFollower:
        """A follower that watches the model's key through ``etcd``."""
        watched = WatchedRange(knobs_key(model).encode())

        def current() -> Knobs | None:
            kv = watched.kvs.get(watched.key)
            if kv is None:
                return None
            try:
                return decode_knobs(kv.value)
            except ValueError as error:
                raise ValueError(f"the value at {knobs_key(model)}: {error}") from None

        follower = Follower(etcd, [watched], lambda *_: knobs.changed(), name=f"knobs of {model}", logger=logger)
        knobs = cls(current, model, apply, follower=follower)  # the follower's callback reaches it when called
        return knobs

    @classmethod
    def from_view(
        cls, view: RegistryView, model: str, apply: Callable[[Knobs | None], Awaitable[None]]
    ) -> KnobsFollower:
        """A follower that takes the model's knobs from ``view``'s watch."""
        knobs = cls(lambda: view.knobs(model), model, apply)
        view.add_knobs_listener(knobs.changed)
        return knobs

    def changed(self) -> None:
        """The stored knobs may have changed: apply them (in the background task)."""
        self._changed.set()

    async def start(self) -> None:
        """Read the knobs (a watch of its own: until its start deadline, then RegistryUnavailable),
        apply them, and follow their changes."""
        if self._follower is not None:
            await self._follower.start()
        await self.apply_current()
        self._task = asyncio.get_running_loop().create_task(self._follow(), name=f"knobs of {self.model}")

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self._follower is not None:
            await self._follower.close()

    async def apply_current(self) -> None:
        """Apply the stored knobs if they changed."""
        self._changed.clear()
        try:
            knobs = self._current()
        except ValueError as exc:  # a bad value: keep what works
            logger.warning("knobs of %s: %s; keeping the current ones", self.model, exc)
            return
        if knobs == self._applied:
            return
        self._applied = knobs  # a failure is not retried until the knobs change again
        try:
            await self._apply(knobs)
        except Exception:
            logger.exception("knobs of %s: could not apply %s", self.model, knobs)

    async def _follow(self) -> None:
        while True:
            await self._changed.wait()
            await self.apply_current()
