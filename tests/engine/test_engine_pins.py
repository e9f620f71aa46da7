"""The engine owns a producer's pinned blocks: freed once by "sent", its deadline (in a step),
a release or an abort; an early "sent" frees them as they are pinned. A fake clock times the
deadlines; every test ends with the pool whole."""

from __future__ import annotations

import pytest

from pdserve.engine.engine import LLMEngine
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import KVRole
from pdserve.types.engine_config import EngineConfig
from pdserve.types.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = list(range(3, 40))  # 37 tokens: 3 blocks of 16
PIN_S = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def clock() -> Clock:
    return Clock()


@pytest.fixture(scope="module")
def engine(checkpoints, clock):
    path, _ = checkpoints("llama")
    return LLMEngine(str(path), EngineConfig(kv_cache_memory=2**20), clock=clock)


def _produce(engine: LLMEngine, request_id: str) -> RequestOutput:
    engine.add_request(request_id, PROMPT, GREEDY, KVRole.PRODUCER, pin_s=PIN_S)
    while True:
        final = next((o for o in engine.step().outputs if o.finished), None)
        if final is not None:
            return final


def _assert_whole(engine: LLMEngine) -> None:
    assert engine.num_held == 0 and not engine.has_unfinished()
    engine.check_idle_integrity()
    assert engine.block_pool.all_free()


@pytest.mark.parametrize("trigger", ["sent", "deadline", "release", "abort"])
def test_a_pin_is_freed_once_by_whichever_trigger_comes_first(engine, clock, trigger):
    final = _produce(engine, trigger)
    assert final.finish_reason == "kv_transfer" and len(final.held_block_ids) == 3
    assert engine.num_held == 1 and engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 3
    assert engine.seconds_to_next_deadline() == PIN_S
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(trigger, PROMPT, GREEDY)
    pins = engine.scheduler.pins
    before = (pins.num_freed_by_sent, pins.num_freed_by_deadline, pins.num_released)
    if trigger == "sent":
        engine.kv_sent(trigger)
    elif trigger == "deadline":
        clock.now += PIN_S - 0.5
        engine.step()
        assert engine.num_held == 1 and engine.seconds_to_next_deadline() == 0.5
        clock.now += 0.5
        assert engine.seconds_to_next_deadline() == 0.0
        assert engine.step().num_scheduled_tokens == 0  # the idle step frees it
    elif trigger == "release":
        assert engine.release_pin(trigger) is True
    else:
        assert engine.abort(trigger) is None
    assert engine.num_held == 0 and engine.seconds_to_next_deadline() is None
    # Every other trigger, coming later, finds nothing to free.
    assert engine.release_pin(trigger) is False
    assert engine.abort(trigger) is None
    engine.kv_sent(trigger)
    clock.now += 2 * PIN_S
    engine.step()
    after = (pins.num_freed_by_sent, pins.num_freed_by_deadline, pins.num_released)
    assert sum(after) - sum(before) == 1
    _assert_whole(engine)


def test_a_sent_that_comes_before_the_pin_frees_it_as_it_is_made(engine):
    engine.kv_sent("early")
    final = _produce(engine, "early")
    assert final.finish_reason == "kv_transfer" and len(final.held_block_ids) == 3
    assert engine.num_held == 0
    _assert_whole(engine)


def test_a_producer_must_say_how_long_to_pin(engine):
    with pytest.raises(ValueError, match="pin_s > 0"):
        engine.add_request("no-pin", PROMPT, GREEDY, KVRole.PRODUCER)
    with pytest.raises(ValueError, match="pin_s > 0"):
        engine.add_request("zero-pin", PROMPT, GREEDY, KVRole.PRODUCER, pin_s=0.0)
    _assert_whole(engine)


def test_release_pins_frees_every_pin(engine):
    for request_id in ("all-1", "all-2"):
        _produce(engine, request_id)
    assert engine.num_held == 2
    engine.release_pins()
    _assert_whole(engine)
