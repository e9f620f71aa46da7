"""The worker registry against a real etcd.

Workers really register under leases, really die by SIGKILL, and etcd really goes away and
comes back, with its data or without.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import msgspec
import pytest

from pdserve.discovery.etcd import EtcdConnection, EtcdEndpoint, RegistryUnavailable, connect
from pdserve.discovery.registration import WorkerRegistration
from pdserve.discovery.registry import (
    Role,
    WorkerEntry,
    decode_entry,
    encode_entry,
    list_workers,
    worker_key,
)
from pdserve.discovery.registry_view import RegistryView
from pdserve.types.engine_load import EngineLoad
from tests.utils.aio import run_scenario
from tests.utils.etcd_server import EtcdServer


@pytest.fixture
def model() -> str:
    """A model name of the test's own, so tests sharing one etcd never see each other's workers."""
    return f"org/tiny-{uuid.uuid4().hex[:8]}"


def make_entry(model: str, worker_id: str, role: str = "prefill", started_at: float = 1.0) -> WorkerEntry:
    return WorkerEntry(
        worker_id=worker_id,
        role=role,
        model=model,
        model_path="/models/tiny",
        endpoint="127.0.0.1:50051",
        nixl=b"\x00agent-metadata\xff",
        block_size=16,
        num_kv_blocks=512,
        max_model_len=2048,
        vocab_size=32000,
        max_num_seqs=64,
        started_at=started_at,
        metrics_port=9100,
    )


async def eventually(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Wait until ``predicate()`` holds; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("url", "host", "port"),
    [
        ("http://127.0.0.1:2379", "127.0.0.1", 2379),
        ("127.0.0.1:2379", "127.0.0.1", 2379),
        ("localhost:2380", "localhost", 2380),
        ("http://etcd.default.svc/", "etcd.default.svc", 2379),
        ("http://[::1]:2379", "::1", 2379),
        ("https://etcd.example:2379", "etcd.example", 2379),
    ],
)
def test_endpoint_parses_the_usual_forms(url: str, host: str, port: int) -> None:
    endpoint = EtcdEndpoint.parse(url)
    assert (endpoint.host, endpoint.port) == (host, port)
    assert EtcdEndpoint.parse(endpoint.url) == endpoint


@pytest.mark.parametrize(
    "url",
    [
        "unix:///run/etcd.sock",
        "127.0.0.1:port",
        "http://:2379",
        "a:1,b:2",
        "http://h:2379/v3",
        "h:99999",
    ],
)
def test_endpoint_rejects_bad_urls_naming_them(url: str) -> None:
    with pytest.raises(ValueError, match="bad etcd URL") as error:
        EtcdEndpoint.parse(url)
    assert repr(url) in str(error.value)


def test_model_names_with_slashes_stay_one_key_segment() -> None:
    assert worker_key("org/name", "decode", "w 1") == "/pdserve/v1/workers/org%2Fname/decode/w%201"


def test_roles_are_typed_in_code_and_plain_strings_in_etcd() -> None:
    entry = make_entry("m", "w", "decode")  # a str given in code becomes its Role
    assert entry.role is Role.DECODE
    assert b'"role":"decode"' in encode_entry(entry)
    assert decode_entry(encode_entry(entry)).role is Role.DECODE
    assert entry.key == worker_key("m", Role.DECODE, "w") == "/pdserve/v1/workers/m/decode/w"
    with pytest.raises(ValueError, match="role must be one of prefill, decode, got 'chef'"):
        make_entry("m", "w", "chef")
    with pytest.raises(msgspec.ValidationError):
        decode_entry(encode_entry(entry).replace(b'"decode"', b'"chef"'))


def test_an_entry_names_its_group_and_one_written_before_groups_still_decodes() -> None:
    rank = msgspec.structs.replace(make_entry("m", "w-dp1", "decode"), group_id="w", group_size=2, group_rank=1)
    assert decode_entry(encode_entry(rank)) == rank
    older = msgspec.json.decode(encode_entry(make_entry("m", "w", "decode")))
    for field in ("group_id", "group_size", "group_rank"):
        del older[field]
    alone = decode_entry(msgspec.json.encode(older))
    assert (alone.group_id, alone.group_size, alone.group_rank) == ("", 1, 0)
    with pytest.raises(ValueError, match=r"group_rank must be in \[0, group_size=2\), got 2"):
        msgspec.structs.replace(rank, group_rank=2)
    with pytest.raises(ValueError, match="group_id must be set for a group of 2 ranks"):
        msgspec.structs.replace(rank, group_id="")


def test_the_registry_and_the_metrics_read_the_engine_load_without_torch() -> None:
    code = "import sys, pdserve.discovery.registry, pdserve.observability.metrics; print('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert loaded.stdout.strip() == "False"


def test_connect_to_a_dead_port_fails_fast_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(RegistryUnavailable, match=f"etcd at {url} is unreachable"):
        run_scenario(connect(url, timeout_s=2.0))
    assert time.monotonic() - start < 2.5


def test_connect_to_a_server_that_never_answers_fails_at_the_deadline() -> None:
    with socket.socket() as silent:  # accepts TCP connections, never speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(RegistryUnavailable, match=f"etcd at {url} is unreachable"):
            run_scenario(connect(url, timeout_s=1.0))
        assert time.monotonic() - start < 2.0


def test_registration_and_view_give_up_at_their_start_timeout() -> None:
    url = f"http://127.0.0.1:{free_port()}"

    async def body() -> None:
        etcd = EtcdConnection(url)
        registration = WorkerRegistration(etcd, make_entry("m", "w"), EngineLoad, start_timeout_s=1.0)
        view = RegistryView(etcd, start_timeout_s=1.0)
        for start in (registration.start, view.start):
            began = time.monotonic()
            with pytest.raises(RegistryUnavailable, match=f"etcd at {url} is unreachable"):
                await start()
            assert time.monotonic() - began < 2.5

    run_scenario(body())


def test_registered_worker_is_visible_with_its_load_and_refreshed(etcd_url: str, model: str) -> None:
    loads = [EngineLoad(running=3, waiting=1, kv_blocks_used=128, kv_blocks_total=512)]
    entry = make_entry(model, "prefill-0")

    async def body() -> None:
        etcd = EtcdConnection(etcd_url)
        registration = WorkerRegistration(
            etcd, entry, lambda: loads[-1], draining=lambda: len(loads) > 1, ttl_s=3, refresh_s=0.5
        )
        view = RegistryView(etcd)
        await registration.start()
        await view.start()
        try:
            seen = view.get("prefill-0")
            assert seen is not None
            # Every field survives the trip.
            assert msgspec.structs.replace(seen, load=entry.load, updated_at=entry.updated_at) == entry
            assert (seen.load.running, seen.load.waiting, seen.load.kv_usage) == (
                3,
                1,
                0.25,
            )
            assert abs(seen.updated_at - time.time()) < 2 and not seen.draining
            assert view.workers(role="prefill", model=model) == [seen]
            assert view.workers(role="decode", model=model) == []
            assert not view.is_stale

            loads.append(EngineLoad(running=7))
            took = await eventually(lambda: view.get("prefill-0").load.running == 7, 2.0, "fresh load seen")
            assert view.get("prefill-0").draining
            assert took < 2.0
        finally:
            await view.close()
            await registration.close()
            await etcd.close()

    run_scenario(body())


def test_close_revokes_at_once_and_listeners_see_membership(etcd_url: str, model: str) -> None:
    events: list[tuple[list[str], list[str]]] = []

    def listener(added: list[WorkerEntry], removed: list[WorkerEntry]) -> None:
        def mine(entries: list[WorkerEntry]) -> list[str]:
            return sorted(f"{e.worker_id}@{e.started_at:g}" for e in entries if e.model == model)

        if mine(added) or mine(removed):
            events.append((mine(added), mine(removed)))

    async def body() -> None:
        etcd = EtcdConnection(etcd_url)
        view = RegistryView(etcd)
        await view.start()
        view.add_listener(listener)
        first = WorkerRegistration(
            etcd,
            make_entry(model, "d0", "decode"),
            EngineLoad,
            ttl_s=3,
            refresh_s=1,
        )
        second = WorkerRegistration(
            etcd,
            make_entry(model, "d1", "decode"),
            EngineLoad,
            ttl_s=3,
            refresh_s=1,
        )
        await first.start()
        await second.start()
        await eventually(lambda: len(view.workers(model=model)) == 2, 2.0, "both workers seen")

        await first.close()
        client = await connect(etcd_url)
        try:  # revoked, not merely expiring: gone from etcd the moment close() returns
            assert [e.worker_id for e in await list_workers(client) if e.model == model] == ["d1"]
        finally:
            await client.close()
        await eventually(
            lambda: [e.worker_id for e in view.workers(model=model)] == ["d1"],
            2.0,
            "d0 gone",
        )

        # The same worker id back after a restart: its old self removed, its new self added.
        restarted = WorkerRegistration(etcd, make_entry(model, "d1", "decode", started_at=2.0), EngineLoad)
        await restarted.start()
        await eventually(lambda: view.get("d1").started_at == 2.0, 2.0, "restarted d1 seen")
        await second.close()  # revokes the old lease; the restarted worker's key is its own now
        await restarted.close()
        await eventually(lambda: view.workers(model=model) == [], 2.0, "all gone")
        await view.close()
        await etcd.close()

    run_scenario(body())
    flat = [(tuple(a), tuple(r)) for a, r in events]
    assert flat[0] in {(("d0@1", "d1@1"), ()), (("d0@1",), ())}
    assert ((), ("d0@1",)) in flat
    assert (("d1@2",), ("d1@1",)) in flat
    assert flat[-1] == ((), ("d1@2",))


@pytest.mark.slow
def test_killed_worker_disappears_within_its_ttl(etcd_url: str, model: str) -> None:
    entry = make_entry(model, "doomed")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD_WORKER,
            etcd_url,
            encode_entry(entry).decode(),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )

    async def body() -> float:
        etcd = EtcdConnection(etcd_url)
        view = RegistryView(etcd)
        await view.start()
        try:
            assert child.stdout.readline().strip() == "registered"
            await eventually(lambda: view.get("doomed") is not None, 2.0, "child registered")
            os.kill(child.pid, signal.SIGKILL)
            child.wait(5)
            killed_at = time.monotonic()
            await eventually(lambda: view.get("doomed") is None, 5.0, "killed worker gone")
            return time.monotonic() - killed_at
        finally:
            await view.close()
            await etcd.close()

    try:
        gone_after = run_scenario(body())
    finally:
        child.kill()
        child.wait()
    print(f"killed -> out of the view: {gone_after * 1000:.0f} ms (TTL 2 s, renewed every 0.5 s)")
    # TTL 2 s, renewed every 0.5 s: the lease had between 1.5 and 2 s left at the kill; etcd
    # checks for expired leases every 0.5 s, and the watch brings the deletion at once.
    assert gone_after < 2 + 0.5


# A worker in its own process: registers, says so, and refreshes until killed.
CHILD_WORKER = """
import asyncio, sys
from pdserve.discovery.etcd import EtcdConnection
from pdserve.discovery.registry import decode_entry
from pdserve.types.engine_load import EngineLoad
from pdserve.discovery.registration import WorkerRegistration

async def main():
    etcd = EtcdConnection(sys.argv[1])
    registration = WorkerRegistration(etcd, decode_entry(sys.argv[2].encode()), EngineLoad, ttl_s=2, refresh_s=0.5)
    await registration.start()
    print("registered", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_garbage_under_the_prefix_is_skipped_with_one_warning(
    etcd_url: str, model: str, caplog: pytest.LogCaptureFixture
) -> None:
    garbage_key = worker_key(model, "decode", "garbage").encode()

    async def body() -> None:
        client = await connect(etcd_url)
        etcd = EtcdConnection(etcd_url)
        registration = WorkerRegistration(etcd, make_entry(model, "good"), EngineLoad, ttl_s=3)
        await registration.start()
        await client.put(garbage_key, b"{not json")
        await client.put(
            worker_key(model, "decode", "bad-role").encode(),
            b'{"worker_id": "x", "role": "chef"}',
        )
        view = RegistryView(etcd)
        try:
            await view.start()
            await client.put(garbage_key, b"{not json")  # a new bad value: one more warning
            await asyncio.sleep(0.3)
            assert [e.worker_id for e in view.workers(model=model)] == ["good"]
            assert [e.worker_id for e in await list_workers(client) if e.model == model] == ["good"]
        finally:
            await view.close()
            await registration.close()
            await etcd.close()
            await client.delete(garbage_key)
            await client.delete(worker_key(model, "decode", "bad-role").encode())
            await client.close()

    with caplog.at_level(logging.WARNING, logger="pdserve.discovery.registry"):
        run_scenario(body())
    warnings = [r.getMessage() for r in caplog.records if "does not decode" in r.getMessage()]
    # The view warns once per bad value (each of its revisions); list_workers once more each.
    assert sum(garbage_key.decode() in w for w in warnings) == 3
    assert len(warnings) == 5


@pytest.mark.slow
@pytest.mark.parametrize("wipe", [False, True], ids=["same-data-dir", "wiped-data-dir"])
def test_worker_survives_an_etcd_restart(etcd_server: EtcdServer, model: str, wipe: bool) -> None:
    async def body() -> None:
        etcd = EtcdConnection(etcd_server.url, 1.0)  # one client for both, as in a decode worker
        registration = WorkerRegistration(etcd, make_entry(model, "w0"), EngineLoad, ttl_s=2, refresh_s=0.5)
        view = RegistryView(etcd, probe_s=0.2, stale_after_s=1.0)
        await registration.start()
        await view.start()
        first_lease = registration.lease_id
        try:
            await eventually(lambda: view.get("w0") is not None, 2.0, "registered")

            etcd_server.stop()
            await eventually(lambda: view.is_stale, 3.0, "view reports stale")
            await eventually(
                lambda: not registration.is_registered,
                3.0,
                "registration notices the outage",
            )
            await asyncio.sleep(2.5)  # longer than the TTL: the lease would be gone on a live etcd
            assert [e.worker_id for e in view.workers(model=model)] == ["w0"]  # the last known view

            await asyncio.to_thread(etcd_server.restart, wipe=wipe)
            # Bounded by the backoff cap plus a probe; generous, for loaded CI machines.
            await eventually(
                lambda: registration.is_registered and not view.is_stale and view.get("w0") is not None,
                8.0,
                "re-registered and seen again",
            )
            if wipe:  # etcd came back empty: a new lease; with its data, etcd kept the old one
                assert registration.lease_id != first_lease
            client = await connect(etcd_server.url)
            info = await client.get_lease_info(registration.lease_id)
            await client.close()
            assert info.TTL > 0 and worker_key(model, "prefill", "w0").encode() in info.keys
        finally:
            await view.close()
            await registration.close()
            await etcd.close()

    run_scenario(body())


def test_close_with_etcd_down_gives_up_quickly(etcd_server: EtcdServer, model: str) -> None:
    async def body() -> None:
        etcd = EtcdConnection(etcd_server.url, 1.0)
        registration = WorkerRegistration(etcd, make_entry(model, "w0"), EngineLoad, ttl_s=2, refresh_s=0.5)
        await registration.start()
        etcd_server.stop()
        start = time.monotonic()
        await registration.close()
        assert time.monotonic() - start < 2.5
        assert registration.lease_id is None
        await etcd.close()

    run_scenario(body())
