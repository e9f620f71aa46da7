"""The worker registry in etcd: who serves which model in which role, where, and how loaded.

Key layout (a contract: routers, the planner, the CLI and the operator read these keys)::

    /pdserve/v1/workers/{model}/{role}/{worker_id}   JSON WorkerEntry, under the worker's lease
    /pdserve/v1/slo/{model}                          reserved: the model's TTFT/ITL targets
    /pdserve/v1/planner/{model}                      reserved: the planner's decisions
    /pdserve/v1/drain/{worker_id}                    reserved: a request to drain a worker
    /pdserve/v1/frontends/{frontend_id}              reserved: live frontends, under leases

Each ``{...}`` component is percent-encoded (``urllib.parse.quote(s, safe="")``), so a
Hugging Face model name such as ``org/name`` stays one path segment and no prefix of one
model's keys matches another model's. Values are JSON (msgspec); a reader skips, with a
warning, any value that does not decode, so one bad writer cannot take routing down.

A worker is live exactly as long as its lease: :class:`WorkerRegistration` keeps the lease
alive and rewrites the entry with fresh load about every second; a worker that stops
(crash, kill -9, lost network) vanishes from every reader within the lease's TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from urllib.parse import quote

import aetcd
import aetcd.rtypes
import msgspec

from pdserve.control_plane.etcd import ETCD_ERRORS, EtcdConnection, RegistryUnavailable

logger = logging.getLogger(__name__)

ROOT = "/pdserve/v1"
WORKERS_PREFIX = f"{ROOT}/workers/"
ROLES = ("prefill", "decode")

# Longest wait for one etcd call: short enough that a hung call cannot outlive a lease.
_MAX_CALL_TIMEOUT_S = 2.0
# Retry pacing while etcd is away: quick first retries, then about once a second.
_MIN_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 1.0


def _segment(name: str) -> str:
    return quote(name, safe="")


def worker_key(model: str, role: str, worker_id: str) -> str:
    """The key of one worker's entry."""
    return f"{WORKERS_PREFIX}{_segment(model)}/{_segment(role)}/{_segment(worker_id)}"


def slo_key(model: str) -> str:
    """The key reserved for a model's latency targets."""
    return f"{ROOT}/slo/{_segment(model)}"


def planner_key(model: str) -> str:
    """The key reserved for the planner's decisions about a model."""
    return f"{ROOT}/planner/{_segment(model)}"


def drain_key(worker_id: str) -> str:
    """The key reserved for a request that a worker drain."""
    return f"{ROOT}/drain/{_segment(worker_id)}"


def frontend_key(frontend_id: str) -> str:
    """The key reserved for a live frontend."""
    return f"{ROOT}/frontends/{_segment(frontend_id)}"


class WorkerLoad(msgspec.Struct, kw_only=True, frozen=True):
    """A worker's load as it last reported it."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    # Prefill only: requests whose blocks stay pinned until a decode worker has pulled them.
    held_requests: int = 0
    queued_prefill_tokens: int = 0
    # A draining worker finishes what it has and must be sent nothing new.
    draining: bool = False
    updated_at: float = 0.0  # unix seconds, stamped by the registration at each write

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use; 0 when the worker has not reported its pool."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class WorkerEntry(msgspec.Struct, kw_only=True, frozen=True):
    """What a worker publishes about itself: identity, where to reach it, its KV geometry."""

    worker_id: str
    role: str  # "prefill" | "decode"
    model: str
    model_path: str
    endpoint: str  # host:port of the worker's gRPC service
    nixl: bytes  # opaque: the KV transfer agent's metadata, for peers to load
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    started_at: float  # unix seconds; tells a restarted worker from its earlier self
    metrics_port: int | None = None
    load: WorkerLoad = WorkerLoad()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")

    @property
    def key(self) -> str:
        """Where this entry lives in etcd."""
        return worker_key(self.model, self.role, self.worker_id)


def encode_entry(entry: WorkerEntry) -> bytes:
    """The JSON value stored under ``entry.key``."""
    return msgspec.json.encode(entry)


def decode_entry(value: bytes) -> WorkerEntry:
    """Parse a stored value; raises msgspec.DecodeError (or ValidationError) when malformed."""
    return msgspec.json.decode(value, type=WorkerEntry)


def decode_entries(kvs: Iterable[aetcd.rtypes.KeyValue], warned: set[tuple[bytes, int]]) -> list[WorkerEntry]:
    """Decode every value, skipping bad ones with one warning per (key, revision) not in ``warned``."""
    entries = []
    for kv in kvs:
        try:
            entries.append(decode_entry(kv.value))
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            if (kv.key, kv.mod_revision) not in warned:
                warned.add((kv.key, kv.mod_revision))
                logger.warning(
                    "skipping registry value at %s that does not decode: %s",
                    kv.key.decode(errors="replace"),
                    exc,
                )
    return entries


async def list_workers(client: aetcd.Client, timeout_s: float = 3.0) -> list[WorkerEntry]:
    """Every registered worker, read once; raises one of ``ETCD_ERRORS`` if etcd fails."""
    response = await asyncio.wait_for(client.get_prefix(WORKERS_PREFIX.encode()), timeout_s)
    return decode_entries(response, set())


class WorkerRegistration:
    """Keeps one worker's entry in etcd, under a lease, for as long as the worker runs.

    ``start()`` grants a lease of ``ttl_s`` and writes the entry with the current ``load()``;
    a background task then, every ``refresh_s``, renews the lease and rewrites the entry with
    a fresh ``load()``. Draining is reported through ``load()`` (``WorkerLoad.draining``): the
    worker owns that state, the registration only publishes it.

    While etcd is unreachable the task retries with a short backoff, every call under a
    deadline, and logs the outage once. When etcd answers again it renews the lease if etcd
    still has it (a restart with the same data dir keeps leases) or registers under a new
    lease (the lease expired meanwhile, or etcd came back empty). Nothing escapes the task.
    """

    def __init__(
        self,
        etcd_url: str,
        entry: WorkerEntry,
        load: Callable[[], WorkerLoad],
        *,
        ttl_s: float = 5.0,
        refresh_s: float = 1.0,
        start_timeout_s: float = 30.0,
    ) -> None:
        if not 0 < refresh_s < ttl_s:
            raise ValueError(f"refresh_s ({refresh_s}) must be positive and below ttl_s ({ttl_s})")
        self.etcd_url = etcd_url
        self.entry = entry
        self._load = load
        self._ttl = max(1, math.ceil(ttl_s))  # etcd leases count whole seconds
        self._refresh_s = refresh_s
        self._start_timeout_s = start_timeout_s
        self._call_timeout_s = min(_MAX_CALL_TIMEOUT_S, ttl_s / 2)
        self._etcd = EtcdConnection(etcd_url, self._call_timeout_s)
        self._lease_id: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._is_registered = False

    @property
    def lease_id(self) -> int | None:
        """The lease the entry is written under, None before start and after close."""
        return self._lease_id

    @property
    def is_registered(self) -> bool:
        """Whether the last write to etcd succeeded."""
        return self._is_registered

    async def start(self) -> None:
        """Register, retrying until ``start_timeout_s``; then keep the entry fresh in the background.

        Raises RegistryUnavailable naming the URL if no registration succeeded in time.
        """
        deadline = time.monotonic() + self._start_timeout_s
        backoff = _MIN_BACKOFF_S
        while True:
            try:
                await self._write()
                break
            except (*ETCD_ERRORS, RegistryUnavailable) as exc:
                await self._etcd.reset()
                if time.monotonic() + backoff > deadline:
                    raise RegistryUnavailable(f"etcd at {self.etcd_url} is unreachable: {exc}") from exc
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, _MAX_BACKOFF_S)
        self._is_registered = True
        logger.info(
            "registered %s at %s (lease %x, ttl %d s)",
            self.entry.worker_id,
            self.etcd_url,
            self._lease_id,
            self._ttl,
        )
        self._task = asyncio.create_task(self._keep_fresh(), name=f"registration {self.entry.worker_id}")

    async def close(self) -> None:
        """Stop refreshing and revoke the lease, so the entry disappears at once.

        If etcd does not answer within a short deadline, give up: the lease expires by itself.
        """
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._lease_id is not None:
            try:
                client = await self._etcd.client()
                await asyncio.wait_for(client.revoke_lease(self._lease_id), self._call_timeout_s)
            except (*ETCD_ERRORS, RegistryUnavailable) as exc:
                logger.info(
                    "could not revoke lease %x (%s); it expires within %d s",
                    self._lease_id,
                    exc,
                    self._ttl,
                )
        await self._etcd.reset()
        self._lease_id = None
        self._is_registered = False

    async def _keep_fresh(self) -> None:
        backoff = _MIN_BACKOFF_S
        while True:
            await asyncio.sleep(self._refresh_s if self._is_registered else backoff)
            try:
                await self._write()
            except Exception as exc:  # the task must outlive any one failure
                if self._is_registered:
                    # Only expected etcd failures are shown without a traceback.
                    expected = isinstance(exc, (*ETCD_ERRORS, RegistryUnavailable))
                    logger.warning(
                        "%s could not refresh its registration; retrying: %s",
                        self.entry.worker_id,
                        exc,
                        exc_info=not expected,
                    )
                self._is_registered = False
                await self._etcd.reset()
                backoff = min(2 * backoff, _MAX_BACKOFF_S)
                continue
            if not self._is_registered:
                logger.info(
                    "%s registered again at %s (lease %x)",
                    self.entry.worker_id,
                    self.etcd_url,
                    self._lease_id,
                )
            self._is_registered = True
            backoff = _MIN_BACKOFF_S

    async def refresh_now(self) -> None:
        """Publish the current load at once (e.g. ``draining``); best effort, bounded by a deadline."""
        try:
            await self._write()
        except (*ETCD_ERRORS, RegistryUnavailable) as exc:
            logger.info("%s could not publish its load now (%s); the next refresh will", self.entry.worker_id, exc)

    async def _write(self) -> None:
        """Renew (or replace) the lease, then write the entry with fresh load under it."""
        timeout = self._call_timeout_s
        client = await self._etcd.client()
        if self._lease_id is not None:
            reply = await asyncio.wait_for(client.refresh_lease(self._lease_id), timeout)
            # etcd answers a lease it no longer has with TTL 0 rather than an error.
            if reply is None or reply.TTL <= 0:
                logger.warning(
                    "lease %x of %s is gone; registering under a new lease",
                    self._lease_id,
                    self.entry.worker_id,
                )
                self._lease_id = None
        if self._lease_id is None:
            lease = await asyncio.wait_for(client.lease(self._ttl), timeout)
            self._lease_id = lease.id
        load = msgspec.structs.replace(self._load(), updated_at=time.time())
        value = encode_entry(msgspec.structs.replace(self.entry, load=load))
        await asyncio.wait_for(client.put(self.entry.key.encode(), value, lease=self._lease_id), timeout)


class RegistryView:
    """A local, eventually consistent copy of the worker registry, refreshed by polling.

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
        self._etcd = EtcdConnection(etcd_url, min(_MAX_CALL_TIMEOUT_S, max(poll_s, 0.5)))
        self._workers: dict[str, WorkerEntry] = {}
        self._listeners: list[Callable[[list[WorkerEntry], list[WorkerEntry]], None]] = []
        self._warned: set[tuple[bytes, int]] = set()
        self._last_read = -math.inf  # time.monotonic() of the last successful read
        self._task: asyncio.Task[None] | None = None

    @property
    def is_stale(self) -> bool:
        """Whether the view has not been refreshed for more than ``stale_after_s``."""
        return time.monotonic() - self._last_read > self._stale_after_s

    def workers(self, role: str | None = None, model: str | None = None) -> list[WorkerEntry]:
        """Registered workers, optionally of one role and model, sorted by worker id."""
        return [
            entry
            for _, entry in sorted(self._workers.items())
            if (role is None or entry.role == role) and (model is None or entry.model == model)
        ]

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
                if time.monotonic() + _MAX_BACKOFF_S > deadline:
                    raise RegistryUnavailable(f"etcd at {self.etcd_url} is unreachable: {exc}") from exc
                await asyncio.sleep(_MAX_BACKOFF_S)
        self._task = asyncio.create_task(self._poll_forever(), name="registry view")

    async def close(self) -> None:
        """Stop polling and close the connection."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
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
        response = await asyncio.wait_for(client.get_prefix(WORKERS_PREFIX.encode()), self._etcd.timeout_s)
        kvs = list(response)
        self._warned &= {(kv.key, kv.mod_revision) for kv in kvs}  # forget values since replaced
        self._last_read = time.monotonic()
        self._apply({entry.worker_id: entry for entry in decode_entries(kvs, self._warned)})

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
