"""BlockPins over a real block pool: each pin freed exactly once — by "sent", its deadline, a
release — an early "sent" honoured, a late one harmless; and the scheduler expiring pins.

A fake clock makes every deadline exact and the tests instant.
"""

from __future__ import annotations

import pytest

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.pins import BlockPins
from pdserve.engine.request import KVRole, Request
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.types.sampling_params import SamplingParams

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Pool:
    """A real pool and manager; ``pins`` frees through it and counts every free per request."""

    def __init__(self, num_blocks: int = 16, early_sent_ttl_s: float = 10.0) -> None:
        self.clock = Clock()
        self.pool = BlockPool(num_blocks, enable_prefix_caching=False)
        self.kv = KVCacheManager(self.pool, BS)
        self.freed: list[str] = []
        self.pins = BlockPins(self._free, clock=self.clock, early_sent_ttl_s=early_sent_ttl_s)

    def _free(self, request_id: str) -> None:
        assert self.kv.holds(request_id), f"{request_id} freed twice"
        self.freed.append(request_id)
        self.kv.free(request_id)

    def pin(self, request_id: str, num_tokens: int = 9, pin_s: float = 30.0) -> None:
        assert self.kv.allocate(request_id, num_tokens)
        self.pins.pin(request_id, pin_s)

    def assert_whole(self) -> None:
        self.pool.check_integrity()
        assert self.pool.all_free() and len(self.pins) == 0
        assert len(self.freed) == len(set(self.freed)), "a pin was freed twice"


def test_sent_frees_the_pin_once():
    p = Pool()
    p.pin("a")
    assert "a" in p.pins and p.pool.num_free_blocks == 16 - 3
    assert p.pins.sent("a") is True
    assert p.freed == ["a"] and p.pins.num_freed_by_sent == 1
    assert p.pins.release("a") is False  # a later release or deadline finds nothing
    p.clock.now += 60
    p.pins.expire()
    assert p.freed == ["a"] and p.pins.num_freed_by_deadline == 0
    p.assert_whole()


def test_deadline_frees_the_pin_at_its_time_not_before():
    p = Pool()
    p.pin("a", pin_s=5.0)
    p.clock.now += 2.0
    p.pin("b", pin_s=5.0)
    assert p.pins.next_deadline == 1005.0
    p.clock.now = 1004.999
    p.pins.expire()
    assert p.freed == []
    p.clock.now = 1005.0
    p.pins.expire()
    assert p.freed == ["a"] and p.pins.next_deadline == 1007.0
    p.clock.now = 1007.0
    p.pins.expire()
    assert p.freed == ["a", "b"] and p.pins.num_freed_by_deadline == 2 and p.pins.next_deadline is None
    # A "sent" after the deadline (a decode worker that pulled too late) frees nothing twice.
    assert p.pins.sent("a") is False
    p.assert_whole()


def test_release_frees_a_pin_and_is_harmless_otherwise():
    p = Pool()
    p.pin("a")
    assert p.pins.release("a") is True
    assert p.pins.release("a") is False
    assert p.pins.release("never-pinned") is False
    assert p.freed == ["a"] and p.pins.num_released == 1
    p.pins.sent("a")  # the notice that follows a release is kept briefly, then forgotten
    p.assert_whole()


def test_an_early_sent_frees_the_pin_as_it_is_made():
    p = Pool()
    assert p.pins.sent("a") is False  # before the pin: kept
    p.clock.now += 9.0
    p.pin("a")
    assert p.freed == ["a"] and p.pins.num_freed_by_sent == 1
    p.assert_whole()


def test_an_early_sent_is_forgotten_after_its_ttl():
    p = Pool(early_sent_ttl_s=2.0)
    p.pins.sent("a")
    p.clock.now += 2.0
    p.pins.expire()
    p.pin("a")
    assert "a" in p.pins and p.freed == []  # pinned as usual: the stale report was dropped
    assert p.pins.sent("a") is True
    p.assert_whole()


def test_pinning_twice_is_refused_and_release_all_frees_everything():
    p = Pool()
    p.pin("a")
    p.pin("b")
    with pytest.raises(ValueError, match="already pinned"):
        p.pins.pin("a", 1.0)
    p.pins.sent("later")
    p.pins.release_all()
    assert sorted(p.freed) == ["a", "b"] and p.pins.num_released == 2
    p.pin("later")  # release_all forgot the early report too
    assert "later" in p.pins
    p.pins.release_all()
    p.assert_whole()


def _producer(request_id: str, num_tokens: int, pin_s: float) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, num_tokens + 1)),
        params=SamplingParams(max_tokens=1),
        eos_token_ids=frozenset(),
        kv_role=KVRole.PRODUCER,
        pin_s=pin_s,
    )


def test_scheduler_pins_a_finished_producer_and_a_step_frees_it_at_the_deadline():
    """The pinned blocks are what a waiting request needs: the step that passes the deadline
    frees them first, then admits it."""
    clock = Clock()
    pool = BlockPool(4, enable_prefix_caching=False)
    kv = KVCacheManager(pool, BS)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), kv, clock=clock)
    producer = _producer("p", 15, pin_s=3.0)
    scheduler.add(producer)
    out = scheduler.schedule()
    assert out.scheduled == [(producer, 15)]
    producer.num_computed_tokens = 15
    producer.append_output(99, None)
    scheduler.finish(producer, "kv_transfer", pin=True)
    assert producer.is_finished and scheduler.num_requests == 0
    assert "p" in scheduler.pins and pool.num_free_blocks == 0

    waiting = _producer("w", 15, pin_s=3.0)
    scheduler.add(waiting)
    clock.now += 2.9
    assert scheduler.schedule().scheduled == []  # every block is pinned
    clock.now += 0.1
    out = scheduler.schedule()
    assert "p" not in scheduler.pins and scheduler.pins.num_freed_by_deadline == 1
    assert out.scheduled == [(waiting, 15)]
    scheduler.finish(waiting, "abort")  # an abort while running frees rather than pins
    assert "w" not in scheduler.pins
    pool.check_integrity()
    assert pool.all_free()
