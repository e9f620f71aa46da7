"""Values kept in etcd under a lease while their owner lives: a worker's entry, a frontend's stats.

``LeasedRecord`` is the mechanism (lease, refresh, outage handling); ``WorkerRegistration``
is a worker's entry with its live load. Both write through the process's ``EtcdConnection``,
which their owner closes after them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import msgspec

from pdserve.discovery.etcd import MAX_CALL_TIMEOUT_S, EtcdConnection
from pdserve.discovery.registry import WorkerEntry, encode_entry
from pdserve.discovery.retry import UNAVAILABLE, Outage, retry_until
from pdserve.lifecycle import cancel_and_wait
from pdserve.types.engine_load import EngineLoad

logger = logging.getLogger(__name__)


class LeasedRecord:
    """Keeps one key in etcd, under a lease, for as long as its owner runs.

    ``start()`` grants a lease of ``ttl_s`` and writes ``value()`` at ``key``; a background
    task then, every ``refresh_s``, renews the lease and rewrites the key with a fresh
    ``value()``. If the owner dies, the lease expires and the key goes with it.

    While etcd is unreachable the task retries with a short backoff, every call under a
    deadline, and logs the outage once. When etcd answers again it renews the lease if etcd
    still has it (a restart with the same data dir keeps leases) or writes under a new
    lease (the lease expired meanwhile, or etcd came back empty). Nothing escapes the task.
    """

    def __init__(
        self,
        etcd: EtcdConnection,
        key: str,
        value: Callable[[], bytes],
        *,
        name: str,
        ttl_s: float = 5.0,
        refresh_s: float = 1.0,
        start_timeout_s: float = 30.0,
    ) -> None:
        if not 0 < refresh_s < ttl_s:
            raise ValueError(f"refresh_s ({refresh_s}) must be positive and below ttl_s ({ttl_s})")
        self.key = key
        self.name = name
        self._etcd = etcd
        self._value = value
        self._ttl = max(1, math.ceil(ttl_s))  # etcd leases count whole seconds
        self._refresh_s = refresh_s
        self._start_timeout_s = start_timeout_s
        self._call_timeout_s = min(MAX_CALL_TIMEOUT_S, ttl_s / 2)
        self._outage = Outage(logger)
        self._lease_id: int | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def lease_id(self) -> int | None:
        """The lease the key is written under, None before start and after close."""
        return self._lease_id

    @property
    def is_registered(self) -> bool:
        """Whether the key was written at start and the last write since succeeded."""
        return self._task is not None and not self._outage.is_out

    async def start(self) -> None:
        """Write the key, retrying until ``start_timeout_s``; then keep it fresh in the background.

        Raises RegistryUnavailable naming the URL if no registration succeeded in time.
        """
        await retry_until(self._etcd, self._write, self._start_timeout_s)
        logger.info(
            "registered %s at %s (lease %x, ttl %d s)",
            self.name,
            self._etcd.url,
            self._lease_id,
            self._ttl,
        )
        self._task = asyncio.create_task(self._keep_fresh(), name=f"registration {self.name}")

    async def close(self) -> None:
        """Stop refreshing and revoke the lease, so the key disappears at once.

        If etcd does not answer within a short deadline, give up: the lease expires by itself.
        """
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self._lease_id is not None:
            try:
                async with self._etcd.use() as client, asyncio.timeout(self._call_timeout_s):
                    await client.revoke_lease(self._lease_id)
            except UNAVAILABLE as exc:
                logger.info(
                    "could not revoke lease %x (%s); it expires within %d s",
                    self._lease_id,
                    exc,
                    self._ttl,
                )
        self._lease_id = None

    async def _keep_fresh(self) -> None:
        while True:
            await asyncio.sleep(self._outage.backoff_s if self._outage.is_out else self._refresh_s)
            try:
                await self._write()
            except Exception as exc:  # the task must outlive any one failure
                self._outage.failed(exc, "%s could not refresh its registration; retrying", self.name)
                continue
            self._outage.answered("%s registered again at %s (lease %x)", self.name, self._etcd.url, self._lease_id)

    async def refresh_now(self) -> None:
        """Write the current value at once (e.g. a worker now ``draining``); best effort, bounded by a deadline."""
        try:
            await self._write()
        except UNAVAILABLE as exc:
            logger.info("%s could not publish its value now (%s); the next refresh will", self.name, exc)

    async def _write(self) -> None:
        """Renew (or replace) the lease, then write a fresh value under it."""
        timeout = self._call_timeout_s
        async with self._etcd.use() as client:
            if self._lease_id is not None:
                async with asyncio.timeout(timeout):
                    reply = await client.refresh_lease(self._lease_id)
                # etcd answers a lease it no longer has with TTL 0 rather than an error.
                if reply is None or reply.TTL <= 0:
                    logger.warning("lease %x of %s is gone; registering under a new lease", self._lease_id, self.name)
                    self._lease_id = None
            if self._lease_id is None:
                async with asyncio.timeout(timeout):
                    lease = await client.lease(self._ttl)
                self._lease_id = lease.id
            async with asyncio.timeout(timeout):
                await client.put(self.key.encode(), self._value(), lease=self._lease_id)


class WorkerRegistration(LeasedRecord):
    """A worker's entry at ``entry.key``, rewritten every ``refresh_s`` with a fresh ``load()``
    and ``draining()``, stamped with the time of the write.

    The worker owns its load and its draining state; the registration only publishes them.
    """

    def __init__(
        self,
        etcd: EtcdConnection,
        entry: WorkerEntry,
        load: Callable[[], EngineLoad],
        *,
        draining: Callable[[], bool] = lambda: False,
        ttl_s: float = 5.0,
        refresh_s: float = 1.0,
        start_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(
            etcd,
            entry.key,
            self._entry_value,
            name=entry.worker_id,
            ttl_s=ttl_s,
            refresh_s=refresh_s,
            start_timeout_s=start_timeout_s,
        )
        self.entry = entry
        self._load = load
        self._draining = draining

    def _entry_value(self) -> bytes:
        entry = msgspec.structs.replace(
            self.entry, load=self._load(), draining=self._draining(), updated_at=time.time()
        )
        return encode_entry(entry)
