"""Following etcd by watch: local copies of key ranges, kept current, that outlive etcd.

- ``WatchedRange``: one range's key-values and the store revision they are complete up to.
  ``list`` reads the range afresh; ``follow`` applies a watch's events from the revision after.
- ``Follower``: ranges followed through a process's shared ``EtcdConnection``. It lists them
  at start (retrying until its deadline), then watches them in the background. After a
  disconnect it resumes each watch from the revision after the last one it applied, so no
  change is lost or applied twice. When etcd has compacted that revision away it lists the
  range afresh; so it does when etcd's revision is behind the copy's (etcd lost its data).
  A probe (one read every ``probe_s``) notices an etcd that keeps the connection open but no
  longer answers, which a watch alone would wait on forever, and dates the last contact.

A change is reported as ``on_change(range, keys)``: the keys changed, or None when the whole
range was listed afresh.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aetcd

from pdserve.discovery.etcd import ETCD_ERRORS, MAX_BACKOFF_S, EtcdConnection
from pdserve.discovery.retry import Outage, retry_until
from pdserve.lifecycle import cancel_and_wait

_PROBE_KEY = b"/pdserve/probe"


class WatchedRange:
    """The keys in ``[key, range_end)`` (just ``key`` when ``range_end`` is None)."""

    def __init__(self, key: bytes, range_end: bytes | None = None) -> None:
        self.key = key
        self.range_end = range_end
        self.kvs: dict[bytes, aetcd.rtypes.KeyValue] = {}
        self.revision = 0  # the copy is complete up to this store revision; 0: never listed

    @classmethod
    def prefix(cls, prefix: str) -> WatchedRange:
        """Every key under ``prefix``."""
        key = prefix.encode()
        return cls(key, aetcd.utils.prefix_range_end(key))

    async def list(self, client: aetcd.Client, timeout_s: float) -> None:
        """Read the range afresh, at one revision."""
        async with asyncio.timeout(timeout_s):
            response = await client.get_range(self.key, self.range_end or self.key + b"\0")
        self.kvs = {kv.key: kv for kv in response}
        self.revision = response.header.revision

    async def follow(
        self,
        client: aetcd.Client,
        on_change: Callable[[WatchedRange, builtins.list[bytes] | None], None],
        timeout_s: float,
    ) -> None:
        """Apply the range's changes from ``revision + 1`` on, listing it afresh when etcd has
        compacted that away; returns never, raises one of ``ETCD_ERRORS`` when the watch fails."""
        while True:
            watch = None
            try:
                watch = await client.watch(self.key, range_end=self.range_end, start_revision=self.revision + 1)
                async for event in watch:
                    kv = event.kv
                    if event.kind == aetcd.rtypes.EventKind.PUT:
                        self.kvs[kv.key] = kv
                    else:
                        self.kvs.pop(kv.key, None)
                    self.revision = kv.mod_revision
                    on_change(self, [kv.key])
            except aetcd.exceptions.RevisionCompactedError:
                await self.list(client, timeout_s)
                on_change(self, None)
                continue
            finally:
                if watch is not None:
                    with contextlib.suppress(*ETCD_ERRORS):
                        async with asyncio.timeout(timeout_s):
                            await watch.cancel()
            # The iteration ended without an error: the client was closed under it.
            raise aetcd.exceptions.ConnectionFailedError("the watch ended")


async def first_failure(*coros: Coroutine[Any, Any, None]) -> None:
    """Run ``coros`` together until one of them fails; cancel the rest and raise its error."""
    tasks = [asyncio.get_running_loop().create_task(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            if not task.done():
                await cancel_and_wait(task)
    for task in done:
        if (error := task.exception()) is not None:
            raise error
    raise RuntimeError("a follower's loop returned")


class Follower:
    """Keeps ``ranges`` current through ``etcd`` (see the module's docstring); reads through
    ``etcd``, which its owner closes after it."""

    def __init__(
        self,
        etcd: EtcdConnection,
        ranges: list[WatchedRange],
        on_change: Callable[[WatchedRange, list[bytes] | None], None],
        *,
        name: str,
        logger: logging.Logger,
        probe_s: float = 1.0,
        start_timeout_s: float = 10.0,
    ) -> None:
        self.name = name
        self.ranges = ranges
        self.last_contact = -math.inf  # time.monotonic() when etcd last answered
        self._etcd = etcd
        self._on_change = on_change
        self._logger = logger
        self._probe_s = probe_s
        self._start_timeout_s = start_timeout_s
        self._timeout_s = etcd.timeout_s
        self._outage = Outage(logger)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """List every range, retrying until ``start_timeout_s``; then follow in the background.

        Raises RegistryUnavailable naming the URL if no list succeeded in time.
        """
        await retry_until(self._etcd, self._list_all, self._start_timeout_s, min_backoff_s=MAX_BACKOFF_S)
        self._task = asyncio.get_running_loop().create_task(self._follow_forever(), name=self.name)

    async def close(self) -> None:
        """Stop following."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _list_all(self) -> None:
        async with self._etcd.use() as client:
            for watched in self.ranges:
                await watched.list(client, self._timeout_s)
        self.last_contact = time.monotonic()
        for watched in self.ranges:
            self._on_change(watched, None)

    def _changed(self, watched: WatchedRange, keys: list[bytes] | None) -> None:
        self.last_contact = time.monotonic()
        self._on_change(watched, keys)

    async def _follow_forever(self) -> None:
        url = self._etcd.url
        while True:
            try:
                async with self._etcd.use() as client:
                    await self._resync(client)
                    self._outage.answered(
                        "%s: etcd at %s answers again; following from revision %d",
                        self.name,
                        url,
                        max(r.revision for r in self.ranges),
                    )
                    await first_failure(
                        self._probe(client), *(r.follow(client, self._changed, self._timeout_s) for r in self.ranges)
                    )
            except Exception as exc:  # the task must outlive any one failure
                self._outage.failed(exc, "%s: etcd at %s unreachable; keeping what it last said", self.name, url)
                await asyncio.sleep(self._outage.backoff_s)

    async def _resync(self, client: aetcd.Client) -> None:
        """List afresh a range whose revision is past etcd's: etcd lost its data since."""
        revision = await self._read_revision(client)
        for watched in self.ranges:
            if revision < watched.revision:
                self._logger.warning(
                    "%s: etcd is at revision %d, behind the %d seen: it lost its data; listing afresh",
                    self.name,
                    revision,
                    watched.revision,
                )
                await watched.list(client, self._timeout_s)
                self._on_change(watched, None)

    async def _probe(self, client: aetcd.Client) -> None:
        while True:
            await asyncio.sleep(self._probe_s)
            await self._read_revision(client)

    async def _read_revision(self, client: aetcd.Client) -> int:
        async with asyncio.timeout(self._timeout_s):
            response = await client.get_range(_PROBE_KEY, _PROBE_KEY + b"\0")
        self.last_contact = time.monotonic()
        return response.header.revision
