"""The embedded etcd answers aetcd's calls as a real etcd does.

The main test runs one script of aetcd calls against a fresh real etcd and a fresh embedded
one and compares every observable result, revisions included. The registry scenarios run
against both in test_registry.py (its ``registry_url`` fixture); here, the in-process use
that ``pdserve up`` makes of it.
"""

from __future__ import annotations

import asyncio
import time

import aetcd
import pytest

from pdserve.discovery.embedded_etcd import EmbeddedEtcd
from pdserve.discovery.etcd import EtcdConnection, RegistryUnavailable, connect
from pdserve.discovery.registration import WorkerRegistration
from pdserve.engine.load import EngineLoad
from pdserve.discovery.registry_view import RegistryView
from tests.discovery.test_registry import eventually, make_entry
from tests.utils.aio import run_scenario
from tests.utils.etcd_server import EtcdServer


def kv_facts(kv: aetcd.rtypes.KeyValue) -> tuple:
    """What a client can observe of a key-value, but the lease id (each server picks its own)."""
    return (
        kv.key,
        kv.value,
        kv.create_revision,
        kv.mod_revision,
        kv.version,
        bool(kv.lease),
    )


async def error_of(call) -> str:
    try:
        await call
    except aetcd.exceptions.ClientError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


async def aetcd_script(client: aetcd.Client) -> list:
    """Every aetcd call pdserve makes, and then some, with what each observed."""
    seen: list = []
    seen.append(("put", (await client.put(b"/a/1", b"x")).header.revision))
    seen.append(
        (
            "put prev_kv new",
            kv_facts((await client.put(b"/a/2", b"y", prev_kv=True)).prev_kv),
        )
    )
    put = await client.put(b"/a/1", b"z", prev_kv=True)
    seen.append(("put prev_kv", put.header.revision, kv_facts(put.prev_kv)))
    await client.put(b"/ab", b"neighbour")  # shares the characters, not the prefix "/a/"
    await client.put(b"/0", b"before")
    got = await client.get(b"/a/1")
    seen.append(("get", got.header.revision, kv_facts(got)))
    seen.append(("get missing", await client.get(b"/a/missing")))
    prefix = await client.get_prefix(b"/a/")
    seen.append(("get_prefix", prefix.count, prefix.more, [kv_facts(kv) for kv in prefix]))
    seen.append(
        (
            "keys_only",
            [kv.value for kv in await client.get_prefix(b"/a/", keys_only=True)],
        )
    )
    seen.append(("get_all", [kv.key for kv in await client.get_all()]))
    seen.append(("get_range", [kv.key for kv in await client.get_range(b"/a/2", b"/b")]))

    lease = await client.lease(5)
    seen.append(("lease ttl", lease.ttl))
    await client.put(b"/a/3", b"leased", lease=lease)
    await client.put(b"/a/4", b"leased", lease=lease.id)
    info = await client.get_lease_info(lease.id)
    seen.append(("lease info", info.grantedTTL, 4 <= info.TTL <= 5, sorted(info.keys)))
    seen.append(("keepalive", (await client.refresh_lease(lease.id)).TTL))
    seen.append(("leased key", kv_facts(await client.get(b"/a/3"))))
    await client.put(b"/a/4", b"unleased")  # a plain put detaches the key from its lease
    seen.append(("detached", sorted((await client.get_lease_info(lease.id)).keys)))

    deleted = await client.delete(b"/a/2", prev_kv=True)
    seen.append(("delete", deleted.header.revision, deleted.deleted, kv_facts(deleted.prev_kv)))
    seen.append(("delete missing", await client.delete(b"/a/2")))
    await client.revoke_lease(lease.id)
    after_revoke = await client.get_prefix(b"/a/")
    seen.append(("revoked", after_revoke.header.revision, [kv.key for kv in after_revoke]))
    seen.append(("delete_prefix", (await client.delete_prefix(b"/a/")).deleted))
    seen.append(("after", [kv.key for kv in await client.get_all()]))

    unknown = 0x1234
    seen.append(("keepalive unknown", (await client.refresh_lease(unknown)).TTL))
    seen.append(("info unknown", (await client.get_lease_info(unknown)).TTL))
    seen.append(("put unknown lease", await error_of(client.put(b"/k", b"v", lease=unknown))))
    seen.append(("revoke unknown", await error_of(client.revoke_lease(unknown))))
    lease = await client.lease(5, lease_id=0x4242)
    seen.append(("chosen id", lease.id, await error_of(client.lease(5, lease_id=0x4242))))
    seen.append(("revision", (await client.get(b"/0")).header.revision))
    return seen


def test_answers_as_a_real_etcd_does(etcd_server: EtcdServer) -> None:
    async def run(url: str) -> list:
        client = await connect(url)
        try:
            return await aetcd_script(client)
        finally:
            await client.close()

    async def run_embedded() -> list:
        etcd = EmbeddedEtcd()
        try:
            return await run(await etcd.start())
        finally:
            await etcd.stop()

    real = run_scenario(run(etcd_server.url))
    embedded = run_scenario(run_embedded())
    assert real[0] == ("put", 2)  # both start from an empty store at revision 1
    assert embedded == real


def test_leases_expire_and_take_their_keys() -> None:
    async def body() -> None:
        etcd = EmbeddedEtcd()
        client = await connect(await etcd.start())
        try:
            lease = await client.lease(1)
            kept = await client.lease(1)
            await client.put(b"/w/expiring", b"v", lease=lease)
            await client.put(b"/w/kept", b"v", lease=kept)
            for _ in range(3):  # 1.5 s: past the first lease's TTL, the second kept alive
                await asyncio.sleep(0.5)
                assert (await client.refresh_lease(kept.id)).TTL == 1
            assert [kv.key for kv in await client.get_prefix(b"/w/")] == [b"/w/kept"]
            assert (await client.refresh_lease(lease.id)).TTL == 0
            assert (await client.get_lease_info(lease.id)).TTL == -1
        finally:
            await client.close()
            await etcd.stop()

    run_scenario(body())


def test_what_it_does_not_implement_says_so() -> None:
    async def body() -> None:
        etcd = EmbeddedEtcd()
        client = await connect(await etcd.start())
        try:
            assert "does not implement Txn" in await error_of(client.transaction([], [], []))
            assert "does not implement Range sorting" in await error_of(client.get_prefix(b"/", sort_order="descend"))
            assert "Method not found" in await error_of(client.status())  # Maintenance is not served
        finally:
            await client.close()
            await etcd.stop()

    run_scenario(body())


def test_registry_in_process_as_pdserve_up_runs_it() -> None:
    async def body() -> None:
        embedded = EmbeddedEtcd()
        etcd = EtcdConnection(await embedded.start(), 1.0)
        loads = [EngineLoad(running=1)]
        registration = WorkerRegistration(etcd, make_entry("tiny", "p0"), lambda: loads[-1], ttl_s=2, refresh_s=0.2)
        view = RegistryView(etcd, poll_s=0.05, stale_after_s=0.5)
        await registration.start()
        await view.start()
        try:
            assert view.get("p0").load.running == 1
            loads.append(EngineLoad(running=2))
            await eventually(lambda: view.get("p0").load.running == 2, 1.0, "fresh load")
            await registration.close()
            await eventually(lambda: view.get("p0") is None, 0.5, "revoked")

            await embedded.stop()  # the registry gone: the view keeps what it knew, and says so
            await eventually(lambda: view.is_stale, 2.0, "stale")
        finally:
            await view.close()
            await registration.close()
            await etcd.close()
            await embedded.stop()

    run_scenario(body())


def test_a_stopped_embedded_etcd_is_unreachable() -> None:
    async def body() -> None:
        etcd = EmbeddedEtcd()
        url = await etcd.start()
        await etcd.stop()
        start = time.monotonic()
        with pytest.raises(RegistryUnavailable, match=url):
            await connect(url, timeout_s=1.0)
        assert time.monotonic() - start < 1.5

    run_scenario(body())
