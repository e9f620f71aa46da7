"""A local, eventually consistent copy of the worker registry and the models' live knobs
(what routers read)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from pdserve.discovery.etcd import MAX_BACKOFF_S, MAX_CALL_TIMEOUT_S, EtcdConnection
from pdserve.discovery.knobs import Knobs, parse_knobs
from pdserve.discovery.registry import KNOBS_PREFIX, WORKERS_PREFIX, Role, WorkerEntry, decode_entries
from pdserve.discovery.retry import Outage, retry_until
from pdserve.lifecycle import cancel_and_wait

logger = logging.getLogger(__name__)


class RegistryView:
    """A local, eventually consistent copy of the worker registry and the models' knobs,
    refreshed by polling.

    Polling (``get_prefix`` every ``poll_s``) rather than a watch is deliberate: a poll is a
    plain read under a deadline, so the view survives etcd restarts, data loss and network
    cuts with no reconnect or resync logic. While etcd is unreachable the view keeps the last
    workers it saw and, after ``stale_after_s`` without a successful read, reports
    ``is_stale``; it keeps retrying meanwhile. It reads through ``etcd``, which its owner
    closes after it.
    """

    def __init__(
        self,
        etcd: EtcdConnection,
        *,
        poll_s: float = 0.5,
        stale_after_s: float = 3.0,
        start_timeout_s: float = 10.0,
    ) -> None:
        self.poll_s = poll_s
        self._etcd = etcd
        self._stale_after_s = stale_after_s
        self._start_timeout_s = start_timeout_s
        self._call_timeout_s = min(MAX_CALL_TIMEOUT_S, max(poll_s, 0.5))
        self._outage = Outage(logger)
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
        """The model's live knobs, or None when none are stored; a stored value that does not
        decode leaves the last good one in force."""
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
        await retry_until(self._etcd, self._poll, self._start_timeout_s, min_backoff_s=MAX_BACKOFF_S)
        self._task = asyncio.create_task(self._poll_forever(), name="registry view")

    async def close(self) -> None:
        """Stop polling."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _poll_forever(self) -> None:
        url = self._etcd.url
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self._poll()
            except Exception as exc:  # the task must outlive any one failure
                self._outage.failed(exc, "registry at %s unreachable; keeping the %d last known workers", url,
                                    len(self._workers))  # fmt: skip
                continue
            self._outage.answered("registry at %s answers again: %d workers", url, len(self._workers))

    async def _poll(self) -> None:
        async with self._etcd.use() as client, asyncio.timeout(self._call_timeout_s):
            workers, knobs = await asyncio.gather(
                client.get_prefix(WORKERS_PREFIX.encode()), client.get_prefix(KNOBS_PREFIX.encode())
            )
        workers, knobs = list(workers), list(knobs)
        kvs = [*workers, *knobs]
        self._warned &= {(kv.key, kv.mod_revision) for kv in kvs}  # forget values since replaced
        self._last_read = time.monotonic()
        self._knobs = parse_knobs(knobs, self._warned, self._knobs)
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
