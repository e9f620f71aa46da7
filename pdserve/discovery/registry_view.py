"""A local, eventually consistent copy of the worker registry and the models' live knobs
(what routers read)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from pdserve.discovery.etcd import (
    ETCD_ERRORS,
    MAX_BACKOFF_S,
    MAX_CALL_TIMEOUT_S,
    EtcdConnection,
    RegistryUnavailable,
)
from pdserve.discovery.knobs import Knobs, parse_knobs
from pdserve.discovery.registry import KNOBS_PREFIX, WORKERS_PREFIX, Role, WorkerEntry, decode_entries
from pdserve.lifecycle import cancel_and_wait

logger = logging.getLogger(__name__)


class RegistryView:
    """A local, eventually consistent copy of the worker registry and the models' knobs,
    refreshed by polling.

    Polling (``get_prefix`` every ``poll_s``) rather than a watch is deliberate: a poll is a
    plain read under a deadline, so the view survives etcd restarts, data loss and network
    cuts with no reconnect or resync logic. While etcd is unreachable the view keeps the last
    workers it saw and, after ``stale_after_s`` without a successful read, reports
    ``is_stale``; it keeps retrying meanwhile.
    """

    def __init__(
        self,
        etcd_url: str,
        *,
        poll_s: float = 0.5,
        stale_after_s: float = 3.0,
        start_timeout_s: float = 10.0,
    ) -> None:
        self.etcd_url = etcd_url
        self._poll_s = poll_s
        self._stale_after_s = stale_after_s
        self._start_timeout_s = start_timeout_s
        self._etcd = EtcdConnection(etcd_url, min(MAX_CALL_TIMEOUT_S, max(poll_s, 0.5)))
        self._workers: dict[str, WorkerEntry] = {}
        self._knobs: dict[str, Knobs] = {}
        self._listeners: list[Callable[[list[WorkerEntry], list[WorkerEntry]], None]] = []
        self._warned: set[tuple[bytes, int]] = set()
        self._last_read = -math.inf  # time.monotonic() of the last successful read
        self._task: asyncio.Task[None] | None = None

    @property
    def is_stale(self) -> bool:
        """Whether the view has not been refreshed for more than ``stale_after_s``."""
        return time.monotonic() - self._last_read > self._stale_after_s

    def workers(self, role: Role | None = None, model: str | None = None) -> list[WorkerEntry]:
        """Registered workers, optionally of one role and model, sorted by worker id."""
        return [
            entry
            for _, entry in sorted(self._workers.items())
            if (role is None or entry.role == role) and (model is None or entry.model == model)
        ]

    def knobs(self, model: str) -> Knobs | None:
        """The model's live knobs (``knobs_store``), or None when none are stored."""
        return self._knobs.get(model)

    def get(self, worker_id: str) -> WorkerEntry | None:
        """One worker's latest entry, or None if it is not registered."""
        return self._workers.get(worker_id)

    def add_listener(self, fn: Callable[[list[WorkerEntry], list[WorkerEntry]], None]) -> None:
        """Call ``fn(added, removed)`` after each poll that changed membership.

        A worker that restarted under the same id (a new ``started_at``) is reported as its
        old entry removed and its new one added. ``fn`` runs on the event loop; it must not block.
        """
        self._listeners.append(fn)

    async def start(self) -> None:
        """Read the registry once, retrying until ``start_timeout_s``; then poll in the background.

        Raises RegistryUnavailable naming the URL if no read succeeded in time.
        """
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            try:
                await self._poll()
                break
            except (*ETCD_ERRORS, RegistryUnavailable) as exc:
                await self._etcd.reset()
                if time.monotonic() + MAX_BACKOFF_S > deadline:
                    raise RegistryUnavailable(f"etcd at {self.etcd_url} is unreachable: {exc}") from exc
                await asyncio.sleep(MAX_BACKOFF_S)
        self._task = asyncio.create_task(self._poll_forever(), name="registry view")

    async def close(self) -> None:
        """Stop polling and close the connection."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        await self._etcd.reset()

    async def _poll_forever(self) -> None:
        is_reachable = True
        while True:
            await asyncio.sleep(self._poll_s)
            try:
                await self._poll()
            except Exception as exc:  # the task must outlive any one failure
                if is_reachable:
                    expected = isinstance(exc, (*ETCD_ERRORS, RegistryUnavailable))
                    logger.warning(
                        "registry at %s unreachable; keeping the %d last known workers: %s",
                        self.etcd_url,
                        len(self._workers),
                        exc,
                        exc_info=not expected,
                    )
                is_reachable = False
                await self._etcd.reset()
                continue
            if not is_reachable:
                logger.info(
                    "registry at %s answers again: %d workers",
                    self.etcd_url,
                    len(self._workers),
                )
            is_reachable = True

    async def _poll(self) -> None:
        client = await self._etcd.client()
        async with asyncio.timeout(self._etcd.timeout_s):
            workers, knobs = await asyncio.gather(
                client.get_prefix(WORKERS_PREFIX.encode()), client.get_prefix(KNOBS_PREFIX.encode())
            )
        workers, knobs = list(workers), list(knobs)
        kvs = [*workers, *knobs]
        self._warned &= {(kv.key, kv.mod_revision) for kv in kvs}  # forget values since replaced
        self._last_read = time.monotonic()
        self._knobs = parse_knobs(knobs, self._warned)
        self._apply({entry.worker_id: entry for entry in decode_entries(workers, self._warned)})

    def _apply(self, workers: dict[str, WorkerEntry]) -> None:
        def identity(entry: WorkerEntry) -> tuple[str, float]:
            return entry.worker_id, entry.started_at

        before = {identity(e): e for e in self._workers.values()}
        after = {identity(e): e for e in workers.values()}
        self._workers = workers
        added = [e for k, e in after.items() if k not in before]
        removed = [e for k, e in before.items() if k not in after]
        if not (added or removed):
            return
        for fn in self._listeners:
            try:
                fn(added, removed)
            except Exception:  # one broken listener must not stop the others
                logger.exception("registry listener %r failed", fn)
