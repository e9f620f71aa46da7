"""A local copy of the worker registry and the models' live knobs (what routers read), kept
current by etcd watches."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pdserve.discovery.etcd import EtcdConnection
from pdserve.discovery.knobs import Knobs, parse_knobs
from pdserve.discovery.registry import KNOBS_PREFIX, WORKERS_PREFIX, Role, WorkerEntry, decode_entries
from pdserve.discovery.watch import Follower, WatchedRange

logger = logging.getLogger(__name__)


class RegistryView:
    """A local copy of the worker registry and the models' knobs, kept current by watches.

    A worker that registers is seen as soon as etcd tells its watchers (milliseconds); one
    whose lease expires as soon as etcd deletes its key. The view follows etcd through
    ``etcd`` (its owner closes that after it) with a ``watch.Follower``: after a disconnect it
    resumes from the last revision it applied, and lists afresh when that was compacted away
    or etcd lost its data. While etcd is unreachable the view keeps the last workers it saw
    and, after ``stale_after_s`` without an answer, reports ``is_stale``.
    """

    def __init__(
        self,
        etcd: EtcdConnection,
        *,
        probe_s: float = 1.0,
        stale_after_s: float = 3.0,
        start_timeout_s: float = 10.0,
    ) -> None:
        self._stale_after_s = stale_after_s
        self._workers_range = WatchedRange.prefix(WORKERS_PREFIX)
        self._knobs_range = WatchedRange.prefix(KNOBS_PREFIX)
        self._follower = Follower(
            etcd,
            [self._workers_range, self._knobs_range],
            self._on_change,
            name="registry view",
            logger=logger,
            probe_s=probe_s,
            start_timeout_s=start_timeout_s,
        )
        self._workers: dict[str, WorkerEntry] = {}
        self._entries: dict[bytes, WorkerEntry] = {}  # by key, decoded once per value
        self._knobs: dict[str, Knobs] = {}
        self._listeners: list[Callable[[list[WorkerEntry], list[WorkerEntry]], None]] = []
        self._knobs_listeners: list[Callable[[], None]] = []
        self._warned: set[tuple[bytes, int]] = set()

    @property
    def is_stale(self) -> bool:
        """Whether etcd has not answered for more than ``stale_after_s``."""
        return time.monotonic() - self._follower.last_contact > self._stale_after_s

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
        """Call ``fn(added, removed)`` after each change of membership.

        A worker that restarted under the same id (a new ``started_at``) is reported as its
        old entry removed and its new one added. ``fn`` runs on the event loop; it must not block.
        """
        self._listeners.append(fn)

    def add_knobs_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` after each change under the knobs prefix (``knobs`` has the new values)."""
        self._knobs_listeners.append(fn)

    async def start(self) -> None:
        """Read the registry once, retrying until ``start_timeout_s``; then watch it.

        Raises RegistryUnavailable naming the URL if no read succeeded in time.
        """
        await self._follower.start()

    async def close(self) -> None:
        """Stop watching."""
        await self._follower.close()

    def _on_change(self, watched: WatchedRange, keys: list[bytes] | None) -> None:
        if watched is self._knobs_range:
            self._forget_warnings()
            self._knobs = parse_knobs(watched.kvs.values(), self._warned, self._knobs)
            self._notify(self._knobs_listeners)
            return
        if keys is None:
            self._forget_warnings()
            self._entries = {}
            keys = list(watched.kvs)
        for key in keys:
            kv = watched.kvs.get(key)
            self._entries.pop(key, None)
            if kv is not None:
                self._entries.update((key, entry) for entry in decode_entries([kv], self._warned))
        self._apply({entry.worker_id: entry for entry in self._entries.values()})

    def _forget_warnings(self) -> None:
        """Forget the bad values since replaced, so that the set stays small."""
        live = {(kv.key, kv.mod_revision) for r in (self._workers_range, self._knobs_range) for kv in r.kvs.values()}
        self._warned &= live

    def _apply(self, workers: dict[str, WorkerEntry]) -> None:
        def identity(entry: WorkerEntry) -> tuple[str, float]:
            return entry.worker_id, entry.started_at

        before = {identity(e): e for e in self._workers.values()}
        after = {identity(e): e for e in workers.values()}
        self._workers = workers
        added = [e for k, e in after.items() if k not in before]
        removed = [e for k, e in before.items() if k not in after]
        if added or removed:
            self._notify(self._listeners, added, removed)

    @staticmethod
    def _notify(listeners: list[Callable[..., None]], *args: object) -> None:
        for fn in listeners:
            try:
                fn(*args)
            except Exception:  # one broken listener must not stop the others
                logger.exception("registry listener %r failed", fn)
