"""Watches against a real etcd: a registered worker is in the view within milliseconds; a
follower resumes from its last revision after etcd restarts, lists afresh when that revision
was compacted away or etcd lost its data."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
import uuid

import pytest

from pdserve.discovery.etcd import EtcdConnection, connect
from pdserve.discovery.registry import encode_entry
from pdserve.discovery.registry_view import RegistryView
from pdserve.discovery.watch import Follower, WatchedRange
from tests.discovery.test_registry import eventually, make_entry
from tests.utils.aio import run_scenario
from tests.utils.etcd_server import EtcdServer

APPEAR_BOUND_S = 1.0  # generous for a loaded machine; typically a few milliseconds


def test_a_registered_worker_is_routable_within_milliseconds(etcd_url: str) -> None:
    model = f"org/watch-{uuid.uuid4().hex[:8]}"

    async def body() -> list[float]:
        etcd = EtcdConnection(etcd_url)
        view = RegistryView(etcd)
        await view.start()
        client = await connect(etcd_url)
        delays = []
        try:
            for i in range(20):
                entry = make_entry(model, f"w{i}")
                written = time.monotonic()  # from the write a registration makes, its round trip included
                await client.put(entry.key.encode(), encode_entry(entry))
                while view.get(f"w{i}") is None:
                    assert time.monotonic() - written < APPEAR_BOUND_S, f"w{i} not in the view in time"
                    await asyncio.sleep(0.0005)
                delays.append(time.monotonic() - written)
                await client.delete(entry.key.encode())
        finally:
            await client.close()
            await view.close()
            await etcd.close()
        return delays

    delays = run_scenario(body())
    print(
        f"registered -> in the view: median {statistics.median(delays) * 1000:.1f} ms, "
        f"max {max(delays) * 1000:.1f} ms over {len(delays)}"
    )
    assert max(delays) < APPEAR_BOUND_S


class _Recorder:
    """What a follower reported: each change's keys, None for a fresh list."""

    def __init__(self) -> None:
        self.changes: list[list[bytes] | None] = []

    def __call__(self, watched: WatchedRange, keys: list[bytes] | None) -> None:
        self.changes.append(keys)


@pytest.mark.slow
@pytest.mark.parametrize("wipe", [False, True], ids=["same-data-dir", "wiped-data-dir"])
def test_a_follower_resumes_after_an_etcd_restart_or_lists_afresh_after_data_loss(
    etcd_server: EtcdServer, wipe: bool
) -> None:
    async def body() -> None:
        etcd = EtcdConnection(etcd_server.url, 1.0)
        watched = WatchedRange.prefix("/t/")
        recorder = _Recorder()
        follower = Follower(etcd, [watched], recorder, name="test", logger=logging.getLogger(__name__), probe_s=0.2)
        client = await connect(etcd_server.url)
        for i in range(30):  # a revision well past where a wiped etcd starts again
            await client.put(b"/other", str(i).encode())
        await client.put(b"/t/a", b"1")
        await client.close()
        await follower.start()
        try:
            assert set(watched.kvs) == {b"/t/a"} and recorder.changes == [None]
            await asyncio.to_thread(etcd_server.restart, wipe=wipe)
            client = await connect(etcd_server.url)  # right away: the follower is still reconnecting
            await client.put(b"/t/b", b"2")
            await client.delete(b"/t/a")
            await client.close()
            await eventually(lambda: set(watched.kvs) == {b"/t/b"}, 10.0, "the changes made during the outage")
            if wipe:  # etcd's revision went back: the copy was listed afresh
                assert None in recorder.changes[1:]
            else:  # resumed from its revision: each change came as an event, nothing listed again
                assert recorder.changes[1:] == [[b"/t/b"], [b"/t/a"]]
        finally:
            await follower.close()
            await etcd.close()

    run_scenario(body())


def test_a_watch_from_a_compacted_revision_lists_afresh(etcd_server: EtcdServer) -> None:
    etcd_url = etcd_server.url  # an etcd of its own: compaction is for everyone
    prefix = f"/compact-{uuid.uuid4().hex[:8]}/"

    async def body() -> None:
        client = await connect(etcd_url)
        watched = WatchedRange.prefix(prefix)
        await client.put(f"{prefix}a".encode(), b"1")
        await watched.list(client, 2.0)
        seen_at = watched.revision
        await client.put(f"{prefix}b".encode(), b"2")
        await client.delete(f"{prefix}a".encode())
        current = (await client.get_range(b"/", b"\0")).header.revision
        await client.compact(current)  # the changes since seen_at are gone from the history
        recorder = _Recorder()
        task = asyncio.create_task(watched.follow(client, recorder, 2.0))
        try:
            await eventually(lambda: recorder.changes == [None], 5.0, "a fresh list")
            assert set(watched.kvs) == {f"{prefix}b".encode()} and watched.revision >= current > seen_at
            await client.put(f"{prefix}c".encode(), b"3")  # and it watches on from there
            await eventually(lambda: recorder.changes == [None, [f"{prefix}c".encode()]], 5.0, "the next change")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()

    run_scenario(body())
