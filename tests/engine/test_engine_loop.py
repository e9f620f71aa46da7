"""The engine on its own thread, driven from asyncio: streams, aborts, the consumer seam."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_loop import EngineLoop, KVAwaited, build_engine
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import KVRole
from pdserve.types.engine_config import EngineConfig
from pdserve.types.sampling_params import SamplingParams
from tests.utils.aio import run_scenario

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(checkpoints):
    path, _ = checkpoints("llama")
    return LLMEngine(str(path), EngineConfig(kv_cache_memory=2**20))


async def _collect(stream) -> list[RequestOutput]:
    return [out async for out in stream.outputs()]


@pytest.mark.slow
def test_concurrent_streams_equal_the_offline_engine(engine):
    prompts = [[5, 6, 7], list(range(2, 40)), [9] * 17]

    async def main():
        loop = EngineLoop(engine)
        loop.start()
        streams = [await loop.add(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
        results = await asyncio.wait_for(asyncio.gather(*(_collect(s) for s in streams)), 60)
        await loop.stop()
        return results

    results = run_scenario(main())
    for prompt, outputs in zip(prompts, results):
        engine.add_request("ref", prompt, GREEDY)
        final = None
        while final is None:
            final = next((o for o in engine.step().outputs if o.finished), None)
        assert [t for o in outputs for t in o.new_token_ids] == final.token_ids
        assert outputs[-1].finished and outputs[-1].first_token_time >= outputs[-1].arrival_time
    engine.check_idle_integrity()


def test_bad_requests_raise_and_aborts_free_everything(engine):
    async def main():
        loop = EngineLoop(engine)
        loop.start()
        with pytest.raises(ValueError, match="vocabulary"):
            await loop.add("bad", [10**6], GREEDY)
        stream = await loop.add("long", list(range(2, 30)), SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.next()
        loop.abort("long")
        await asyncio.sleep(0.2)
        load = loop.load
        await loop.stop()
        return load

    load = run_scenario(main())
    assert load.running == 0 and load.kv_blocks_used == 0
    engine.check_idle_integrity()


def test_producer_holds_blocks_and_consumer_waits_for_kv(engine):
    prompt = list(range(3, 40))

    async def main():
        loop = EngineLoop(engine)
        loop.start()
        produced = await _collect(await loop.add("p", prompt, GREEDY, KVRole.PRODUCER, pin_s=30.0))
        held = loop.load.held_requests
        consumer = await loop.add("c", prompt, GREEDY, KVRole.CONSUMER)
        awaited = await asyncio.wait_for(consumer.next(), 10)
        awaiting = loop.load  # a request awaiting its KV holds blocks: it counts as running
        # Same engine, so "pulling" is copying the producer's blocks into the consumer's.
        kv = engine.kv_cache.data
        for src, dst in zip(produced[-1].held_block_ids, awaited.block_ids):
            kv[dst] = kv[src]
        loop.kv_sent("p")
        await loop.kv_received("c", produced[-1].token_ids[0])
        rest = await asyncio.wait_for(_collect(consumer), 30)
        await loop.stop()
        return produced, held, awaited, awaiting, rest

    produced, held, awaited, awaiting, rest = run_scenario(main())
    assert produced[-1].finish_reason == "kv_transfer" and held == 1
    assert (awaiting.running, awaiting.awaiting_kv, awaiting.held_requests) == (1, 1, 1)
    assert isinstance(awaited, KVAwaited) and len(awaited.block_ids) >= len(produced[-1].held_block_ids)
    engine.add_request("ref", prompt, GREEDY)
    final = None
    while final is None:
        final = next((o for o in engine.step().outputs if o.finished), None)
    assert produced[-1].token_ids + [t for o in rest for t in o.new_token_ids] == final.token_ids
    engine.check_idle_integrity()


def test_a_caller_cancelled_while_its_command_waits_leaves_the_engine_running(engine):
    """The engine thread runs a command whose caller was cancelled; the outcome has nowhere
    to go and must not stop the thread, and a cancelled add must not leave its request behind."""

    async def main():
        loop = EngineLoop(engine)
        loop.start()
        blocker = asyncio.ensure_future(loop._call(lambda: __import__("time").sleep(0.3)))  # holds the thread
        await asyncio.sleep(0.05)
        # Queued behind the blocker, for a consumer: it would await KV forever if left in the engine.
        add = asyncio.ensure_future(loop.add("gone", list(range(2, 20)), GREEDY, KVRole.CONSUMER))
        failing = asyncio.ensure_future(loop._call(lambda: 1 / 0))
        await asyncio.sleep(0.05)
        add.cancel()
        failing.cancel()
        await blocker
        await asyncio.sleep(0.2)
        assert loop.error is None
        stream = await loop.add("after", [5, 6, 7], GREEDY)  # the engine still serves
        outputs = await asyncio.wait_for(_collect(stream), 30)
        await loop.stop()
        return outputs

    outputs = run_scenario(main())
    assert outputs[-1].finished and len([t for o in outputs for t in o.new_token_ids]) == 6
    engine.check_idle_integrity()  # the cancelled consumer was aborted: every block is free


def test_a_repeated_request_id_is_refused_and_leaves_the_request_holding_it_whole(engine):
    """A second add under an id in use, running or pinned, is refused; the first request's
    stream still ends normally and its pin stays until its own release."""
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def main():
        loop = EngineLoop(engine)
        loop.start()
        stream = await loop.add("r1", [5, 6, 7], long)
        await stream.next()  # running
        for role in (KVRole.LOCAL, KVRole.CONSUMER):
            with pytest.raises(ValueError, match="already in use"):
                await loop.add("r1", [8, 9], GREEDY, role)
        outputs = await asyncio.wait_for(_collect(stream), 30)
        await _collect(await loop.add("p1", list(range(3, 40)), GREEDY, KVRole.PRODUCER, pin_s=30.0))
        with pytest.raises(ValueError, match="already in use"):  # the pin holds the id after the stream ended
            await loop.add("p1", [8, 9], GREEDY, KVRole.PRODUCER, pin_s=30.0)
        await asyncio.sleep(0.1)
        held = loop.load.held_requests
        released = await loop.release_pin("p1")
        await loop.stop()
        return outputs, held, released

    outputs, held, released = run_scenario(main())
    assert outputs[-1].finished and outputs[-1].finish_reason == "length" and len(outputs[-1].token_ids) == 40
    assert held == 1 and released
    engine.check_idle_integrity()


def test_retune_changes_the_scheduler_limits_live_within_the_start_up_ones(checkpoints):
    path, _ = checkpoints("llama")
    engine = LLMEngine(str(path), EngineConfig(kv_cache_memory=2**20, max_num_seqs=4, max_num_batched_tokens=64))

    async def main():
        loop = EngineLoop(engine)
        loop.start()
        try:
            with pytest.raises(ValueError, match=r"max_num_seqs must be in \[1, 4\]"):
                await loop.retune(8, 64)
            with pytest.raises(ValueError, match=r"max_num_batched_tokens must be in \[max_num_seqs=2, 64\]"):
                await loop.retune(2, 128)
            await loop.retune(1, 32)
            # One sequence at a time: while the first decodes, the others wait.
            streams = [await loop.add(f"r{i}", [5, 6, 7], GREEDY) for i in range(3)]
            await streams[0].next()
            during = loop.load
            results = await asyncio.wait_for(asyncio.gather(*(_collect(s) for s in streams)), 60)
            return during, results, loop.load
        finally:
            await loop.stop()

    during, results, after = run_scenario(main())
    assert during.running <= 1 and during.max_num_seqs == 1 and during.max_num_batched_tokens == 32
    assert all(out[-1].finished for out in results)
    assert (engine.scheduler.config.max_num_seqs, engine.scheduler.config.max_num_batched_tokens) == (1, 32)
    engine.check_idle_integrity()


def test_an_idle_loop_frees_a_pin_at_its_deadline_and_stop_frees_the_rest(engine):
    """Nothing runs and no command comes, yet the pin's deadline wakes the engine thread."""

    async def main():
        loop = EngineLoop(engine)
        loop.start()
        try:
            await _collect(await loop.add("short", [5, 6, 7], GREEDY, KVRole.PRODUCER, pin_s=0.5))
            await _collect(await loop.add("released", [5, 6, 8], GREEDY, KVRole.PRODUCER, pin_s=60.0))
            await _collect(await loop.add("kept", [5, 6, 9], GREEDY, KVRole.PRODUCER, pin_s=60.0))
            held = loop.load.held_requests
            released = [await loop.release_pin("released"), await loop.release_pin("released")]
            await asyncio.sleep(1.5)  # no command meanwhile: only the deadline can wake the thread
            after_deadline = loop.load.held_requests
        finally:
            await loop.stop()
        return held, released, after_deadline

    held, released, after_deadline = run_scenario(main())
    assert held == 3 and released == [True, False] and after_deadline == 1
    assert engine.scheduler.pins.num_freed_by_deadline >= 1
    assert engine.num_held == 0  # stop freed "kept"
    engine.check_idle_integrity()
    assert engine.block_pool.all_free()


def test_a_consumer_is_admitted_and_resumed_while_a_step_runs_and_joins_that_step(engine):
    """The hand-off costs less than a step: with the model run held open, a consumer gets its
    blocks and its KV notice, and is resumed; it joins the run under way at a layer boundary."""
    prompt = list(range(3, 40))
    in_run, release = threading.Event(), threading.Event()
    scheduled: list[list[str]] = []
    execute = engine.runner.execute

    def held_execute(inputs, joiners=None):
        in_run.set()
        assert release.wait(30), "the test never released the model run"
        logits = execute(inputs, joiners)
        scheduled.append([r.request_id for r in inputs.sampling_requests])  # as it ran
        return logits

    async def main():
        loop = EngineLoop(engine)
        loop.start()
        try:
            produced = await _collect(await loop.add("p", prompt, GREEDY, KVRole.PRODUCER, pin_s=30.0))
            engine.runner.execute = held_execute
            local = await loop.add("local", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
            await asyncio.get_running_loop().run_in_executor(None, in_run.wait, 30)
            consumer = await asyncio.wait_for(loop.add("c", prompt, GREEDY, KVRole.CONSUMER), 5)
            awaited = consumer._items.get_nowait()  # there already: no step has ended yet
            kv = engine.kv_cache.data
            for src, dst in zip(produced[-1].held_block_ids, awaited.block_ids):
                kv[dst] = kv[src]
            loop.kv_sent("p")
            await asyncio.wait_for(loop.kv_received("c", produced[-1].token_ids[0]), 5)
            steps_before = len(scheduled)  # none has ended
            release.set()
            rest = await asyncio.wait_for(_collect(consumer), 30)
            await asyncio.wait_for(_collect(local), 30)
            return produced, awaited, steps_before, rest
        finally:
            release.set()
            engine.runner.execute = execute
            await loop.stop()

    produced, awaited, steps_before, rest = run_scenario(main())
    assert isinstance(awaited, KVAwaited) and steps_before == 0
    # The run under way during the hand-off (local's prompt) took it in, as its decode row.
    assert scheduled[0] == ["c", "local"]
    engine.add_request("ref", prompt, GREEDY)
    final = None
    while final is None:
        final = next((o for o in engine.step().outputs if o.finished), None)
    assert produced[-1].token_ids + [t for o in rest for t in o.new_token_ids] == final.token_ids
    engine.check_idle_integrity()


def test_an_engine_is_built_on_a_thread_that_then_ends(checkpoints):
    # The builder's OpenMP team must not outlive the build (build_engine's docstring says why).
    path, _ = checkpoints("llama")
    builders: list[threading.Thread] = []

    def build() -> LLMEngine:
        builders.append(threading.current_thread())
        return LLMEngine(str(path), EngineConfig(kv_cache_memory=2**20))

    async def main():
        engine = await build_engine(build)
        with pytest.raises(ValueError, match="kv_cache_memory"):
            await build_engine(lambda: LLMEngine(str(path), EngineConfig(kv_cache_memory=-1)))
        return engine

    assert isinstance(run_scenario(main()), LLMEngine)
    assert builders[0] is not threading.main_thread() and not builders[0].is_alive()


def test_the_loop_warms_its_engine_up_on_the_engine_thread_before_the_first_request(checkpoints):
    path, _ = checkpoints("llama")
    engine = LLMEngine(str(path), EngineConfig(kv_cache_memory=2**20))
    step_threads: list[str] = []
    steps_before_add: list[int] = []
    step, add_request = engine.step, engine.add_request

    def recording_step(*args, **kwargs):
        step_threads.append(threading.current_thread().name)
        return step(*args, **kwargs)

    def recording_add(request_id, *args, **kwargs):
        if request_id == "first":
            steps_before_add.append(len(step_threads))
        return add_request(request_id, *args, **kwargs)

    engine.step, engine.add_request = recording_step, recording_add

    async def main():
        loop = EngineLoop(engine)
        loop.start()
        outputs = await asyncio.wait_for(_collect(await loop.add("first", [5, 6, 7], GREEDY)), 60)
        await loop.stop()
        return outputs

    outputs = run_scenario(main())
    assert steps_before_add == [2]  # the warm-up's prompt step and decode step
    assert set(step_threads) == {"pdserve-engine"}
    assert outputs[-1].finished and len([t for o in outputs for t in o.new_token_ids]) == GREEDY.max_tokens
    engine.check_idle_integrity()


def test_a_request_that_waits_for_the_step_under_way_counts_that_wait_as_queue_time(checkpoints):
    path, _ = checkpoints("llama")
    engine = LLMEngine(str(path), EngineConfig(kv_cache_memory=2**20))
    step = engine.step

    def slow_step(*args, **kwargs):
        output = step(*args, **kwargs)
        time.sleep(0.3)  # a long step, with the engine's lock held as in a real one
        return output

    async def main():
        loop = EngineLoop(engine)
        loop.start()
        engine.step = slow_step
        running = await loop.add("running", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        await running.next()
        await asyncio.sleep(0.1)  # the next step is under way
        queued = await loop.add("queued", [8, 9], SamplingParams(max_tokens=1, ignore_eos=True))
        outputs = await asyncio.wait_for(_collect(queued), 60)
        await asyncio.wait_for(_collect(running), 60)
        await loop.stop()
        return outputs[-1]

    final = run_scenario(main())
    assert final.first_scheduled_time - final.arrival_time > 0.1
