"""Liveness of the engine thread: the heartbeat it beats, and the engine loop's verdict when
the thread idles, is held inside a step, or is gone."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.heartbeat import Heartbeat
from pdserve.engine.request import KVRole
from pdserve.types.engine_config import EngineConfig
from pdserve.types.sampling_params import SamplingParams
from tests.utils.aio import run_scenario

DEADLINE_S = 0.5


def test_a_heartbeat_stalls_when_its_thread_stops_beating():
    heartbeat = Heartbeat()
    assert heartbeat.stall(DEADLINE_S) == "not started"
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.02):
            heartbeat.beat()

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        time.sleep(2 * DEADLINE_S)
        assert heartbeat.stall(DEADLINE_S) is None
    finally:
        stop.set()
        thread.join()
    time.sleep(2 * DEADLINE_S)
    assert "no progress" in heartbeat.stall(DEADLINE_S)


@pytest.fixture(scope="module")
def engine(checkpoints):
    path, _ = checkpoints("llama")
    return LLMEngine(str(path), EngineConfig(kv_cache_memory=2**20))


async def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_the_engine_thread_is_live_idle_and_stalled_inside_a_held_step(engine):
    """Idle past the deadline it stays live (idle waits beat); a step held in a real blocking
    call (the producer hook the engine thread calls) turns it stalled until released."""
    held = threading.Event()
    release = threading.Event()

    def block(_output) -> None:
        held.set()
        release.wait(30)

    async def main():
        loop = EngineLoop(engine)
        assert loop.stall(DEADLINE_S) == "engine thread not running"
        loop.start()
        await _until(lambda: loop.is_warm)
        await asyncio.sleep(3 * DEADLINE_S)  # idle, longer than the deadline
        assert loop.stall(DEADLINE_S) is None
        loop.on_produced = block
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        stream = await loop.add("held", [5, 6, 7], params, KVRole.PRODUCER, pin_s=5.0)
        await _until(held.is_set)
        await _until(lambda: loop.stall(DEADLINE_S) is not None, timeout_s=5 * DEADLINE_S)
        stalled = loop.stall(DEADLINE_S)
        release.set()
        [final] = [o async for o in stream.outputs()]
        await _until(lambda: loop.stall(DEADLINE_S) is None, timeout_s=5 * DEADLINE_S)
        loop.abort("held")
        await loop.stop()
        return stalled, final, loop.stall(DEADLINE_S)

    stalled, final, after_stop = run_scenario(main())
    assert stalled.startswith("engine thread: no progress")
    assert final.finish_reason == "kv_transfer"
    assert after_stop == "engine thread not running"
    engine.check_idle_integrity()
