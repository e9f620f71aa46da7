"""The shared etcd connection and the retry helpers, against a real etcd that stops and comes back."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import pytest

from pdserve.discovery.etcd import EtcdConnection, RegistryUnavailable, connect
from pdserve.discovery.retry import Outage, retry_until
from tests.discovery.test_registry import free_port
from tests.utils.aio import run_scenario
from tests.utils.etcd_server import EtcdServer


def test_a_failed_call_drops_the_shared_client_without_cancelling_another_call(etcd_url: str) -> None:
    key = f"/pdserve-test/{uuid.uuid4().hex}".encode()

    async def body() -> None:
        etcd = EtcdConnection(etcd_url)
        writer = await connect(etcd_url)
        watching = asyncio.Event()

        async def watch():
            async with etcd.use() as client, asyncio.timeout(10):
                watching.set()
                return client, await client.watch_once(key)

        try:
            watch_task = asyncio.create_task(watch())
            await watching.wait()
            await asyncio.sleep(0.3)  # the watch is in flight on the client
            with pytest.raises(TimeoutError):
                async with etcd.use():
                    raise TimeoutError  # what a call past its deadline raises
            async with etcd.use() as fresh, asyncio.timeout(5):
                await fresh.get(key)  # a new client dialled for the next call
            await writer.put(key, b"seen")
            old, event = await watch_task  # the call on the dropped client was not cancelled
            assert event.kv.value == b"seen"
            assert fresh is not old
            assert old.channel is None  # closed once its last call ended
        finally:
            await etcd.close()
            await writer.delete(key)
            await writer.close()

    run_scenario(body())


@pytest.mark.slow
def test_retry_until_outlasts_an_etcd_that_comes_back(etcd_server: EtcdServer) -> None:
    etcd_server.stop()

    async def body() -> float:
        etcd = EtcdConnection(etcd_server.url, 1.0)
        attempts = 0

        async def read() -> bool:
            nonlocal attempts
            attempts += 1
            async with etcd.use() as client, asyncio.timeout(1.0):
                return await client.get(b"/pdserve-test/missing") is None

        loop = asyncio.get_running_loop()
        began = time.monotonic()
        back = loop.run_in_executor(None, lambda: (time.sleep(1.0), etcd_server.start()))
        try:
            assert await retry_until(etcd, read, 30.0)
        finally:
            await back
            await etcd.close()
        assert attempts > 1
        return time.monotonic() - began

    assert run_scenario(body()) < 30.0


def test_retry_until_gives_up_at_its_deadline_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"

    async def body() -> None:
        etcd = EtcdConnection(url)

        async def read() -> None:
            async with etcd.use() as client:
                await client.get(b"/x")

        began = time.monotonic()
        with pytest.raises(RegistryUnavailable, match=f"etcd at {url} is unreachable"):
            await retry_until(etcd, read, 1.5)
        assert 1.0 < time.monotonic() - began < 2.5  # 0.2 + 0.4 + 0.8 s of backoff, then the next would pass it

    run_scenario(body())


def test_retry_until_passes_other_errors_straight_through() -> None:
    attempts = []

    async def attempt() -> None:
        attempts.append(time.monotonic())
        raise ValueError("a bad value is not an outage")

    with pytest.raises(ValueError, match="not an outage"):
        run_scenario(retry_until(EtcdConnection("http://127.0.0.1:9"), attempt, 10.0))
    assert len(attempts) == 1


def test_an_outage_is_logged_once_when_it_begins_and_once_when_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage(logging.getLogger("tests.outage"), min_backoff_s=0.2, max_backoff_s=1.0)
    with caplog.at_level(logging.INFO, logger="tests.outage"):
        for _ in range(4):
            outage.failed(TimeoutError("no answer"), "etcd at %s unreachable", "URL")
        assert outage.is_out and outage.backoff_s == 1.0  # 0.4, 0.8, then capped
        outage.answered("etcd at %s answers again", "URL")
        outage.answered("etcd at %s answers again", "URL")
        assert not outage.is_out and outage.backoff_s == 0.2
        outage.failed(RuntimeError("a bug"), "the loop failed")
        outage.answered()  # no message: the end of this outage goes unsaid
    records = [r for r in caplog.records if r.name == "tests.outage"]
    assert [r.getMessage() for r in records] == [
        "etcd at URL unreachable: no answer",
        "etcd at URL answers again",
        "the loop failed: a bug",
    ]
    assert [r.levelno for r in records] == [logging.WARNING, logging.INFO, logging.WARNING]
    assert records[0].exc_info is None and records[2].exc_info[1].args == ("a bug",)  # a bug's traceback is shown
