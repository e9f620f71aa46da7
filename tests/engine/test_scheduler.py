"""Scheduler: continuous batching over a real (small) KVCacheManager, with the model faked.

``Sim`` plays the engine: after each ``schedule()`` it marks the scheduled tokens computed,
caches the full blocks, appends a fake token to every request whose known tokens are now all
computed, and finishes it with ``"length"`` at ``max_tokens``. Every step checks the pool and
the scheduler's invariants; every scenario ends with the pool whole.
"""

import random

import pytest

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import KVRole, Request, RequestStatus
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.types.sampling_params import SamplingParams

BS = 4


def fake_token(request: Request) -> int:
    """Deterministic per request and position, so kept outputs can be checked after preemption."""
    return 10_000 + 100 * int(request.request_id.lstrip("r") or 0) + len(request.output_token_ids)


def expected_outputs(request: Request, n: int) -> list[int]:
    base = 10_000 + 100 * int(request.request_id.lstrip("r") or 0)
    return [base + i for i in range(n)]


class Sim:
    def __init__(
        self,
        num_blocks: int,
        *,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int = 64,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.pool = BlockPool(num_blocks, enable_prefix_caching=enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, BS)
        if max_num_seqs is None:
            max_num_seqs = min(8, max_num_batched_tokens)
        self.config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        self.scheduler = Scheduler(self.config, self.kv)
        self.requests: list[Request] = []
        self.outputs: list[SchedulerOutput] = []
        self.num_steps = 0

    def add(self, prompt: list[int], max_tokens: int = 4, kv_role: KVRole = KVRole.LOCAL) -> Request:
        request = Request(
            request_id=f"r{len(self.requests)}",
            prompt_token_ids=list(prompt),
            params=SamplingParams(max_tokens=max_tokens),
            eos_token_ids=frozenset(),
            kv_role=kv_role,
        )
        self.requests.append(request)
        self.scheduler.add(request)
        return request

    def step(self) -> SchedulerOutput:
        sched, kv, cfg = self.scheduler, self.kv, self.config
        was_running = list(sched.running)
        decodes = [r for r in was_running if r.num_tokens - r.num_computed_tokens == 1]
        out = sched.schedule()
        self.num_steps += 1
        self.outputs.append(out)

        # The step's invariants.
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert len(sched.running) <= cfg.max_num_seqs
        ids = [r.request_id for r, _ in out.scheduled]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        for request, n in out.scheduled:
            assert request.status is RequestStatus.RUNNING and request in sched.running
            assert 1 <= n <= request.num_tokens - request.num_computed_tokens
            assert len(kv.block_table(request.request_id)) >= kv.num_blocks_for(request.num_computed_tokens + n)
        # Running requests come before admissions, decodes first; a running decode is never
        # left out (unless preempted or ended).
        continuing = [r for r, _ in out.scheduled if r in was_running]
        assert [r for r, _ in out.scheduled[: len(continuing)]] == continuing
        is_decode = [r.num_tokens - r.num_computed_tokens == 1 for r in continuing]
        assert is_decode == sorted(is_decode, reverse=True)
        for request in decodes:
            assert request.request_id in ids or request in out.preempted or request in out.finished
        for request in out.preempted:
            assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
            assert not kv.holds(request.request_id) and request in sched.waiting
        for request in out.finished:
            assert request.is_finished and not kv.holds(request.request_id)
        for request in sched.waiting:
            assert request.status is RequestStatus.WAITING and not kv.holds(request.request_id)

        # The fake model run.
        for request, n in out.scheduled:
            request.num_computed_tokens += n
            kv.cache_full_blocks(request.request_id, request.token_ids, request.num_computed_tokens)
            if request.num_computed_tokens == request.num_tokens:
                request.append_output(fake_token(request), None)
                if len(request.output_token_ids) >= request.params.max_tokens:
                    sched.finish(request, "length")
                    assert not kv.holds(request.request_id)
        self.pool.check_integrity()
        return out

    def deliver_kv(self) -> list[Request]:
        """Decode role: the peer has written every awaiting request's prompt KV."""
        delivered = []
        for request_id in list(self.scheduler.awaiting_kv):
            request = self.scheduler.awaiting_kv[request_id]
            delivered.append(self.scheduler.kv_received(request_id, fake_token(request)))
            assert len(self.scheduler.running) <= self.config.max_num_seqs
        return delivered

    def run(self, max_steps: int = 500, deliver_kv: bool = True) -> None:
        while self.scheduler.num_requests:
            assert self.num_steps < max_steps, "no progress: the scheduler is looping"
            self.step()
            if deliver_kv:
                for request in self.deliver_kv():
                    if len(request.output_token_ids) >= request.params.max_tokens:
                        self.scheduler.finish(request, "length")
        self.assert_whole()

    def assert_whole(self) -> None:
        self.pool.check_integrity()
        assert self.pool.all_free(), "blocks leaked"
        assert not self.scheduler.waiting and not self.scheduler.running and not self.scheduler.awaiting_kv


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# -- config -------------------------------------------------------------------------------------


def test_scheduler_config_checks():
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)
    SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4)


# -- basic flow ---------------------------------------------------------------------------------


def test_single_request_prefill_then_decodes():
    sim = Sim(8)
    r = sim.add(prompt(0, 6), max_tokens=3)
    out = sim.step()
    assert [(x.request_id, n) for x, n in out.scheduled] == [("r0", 6)]
    assert r.num_cached_tokens == 0 and r.output_token_ids == expected_outputs(r, 1)
    for _ in range(2):
        out = sim.step()
        assert [(x.request_id, n) for x, n in out.scheduled] == [("r0", 1)]
    assert r.is_finished and r.finish_reason == "length"
    assert r.output_token_ids == expected_outputs(r, 3)
    assert sim.step().is_empty
    sim.assert_whole()


def test_token_budget_and_max_num_seqs_respected_each_step():
    sim = Sim(64, max_num_seqs=3, max_num_batched_tokens=10)
    for i in range(8):
        sim.add(prompt(100 * i, 3 + 5 * i % 17), max_tokens=2 + i % 4)
    max_running = 0
    while sim.scheduler.num_requests:
        out = sim.step()  # asserts budget and seq caps
        max_running = max(max_running, len(sim.scheduler.running))
        assert out.num_tokens <= 10
    assert max_running == 3
    # Full steps were used: the budget is a real constraint here.
    assert max(o.num_tokens for o in sim.outputs) == 10
    for r in sim.requests:
        assert r.finish_reason == "length" and r.output_token_ids == expected_outputs(r, r.params.max_tokens)
    sim.assert_whole()


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_invariants_and_everyone_finishes(seed):
    rng = random.Random(seed)
    sim = Sim(rng.randint(10, 16), max_num_seqs=rng.randint(1, 5), max_num_batched_tokens=rng.randint(5, 16))
    shared = prompt(7, 8)
    for i in range(12):
        head = shared if rng.random() < 0.5 else []
        sim.add(head + prompt(1000 * i, rng.randint(1, 14)), max_tokens=rng.randint(1, 10))
    # Requests keep arriving while others run.
    for _ in range(3):
        sim.step()
    for i in range(12, 16):
        sim.add(shared + prompt(1000 * i, rng.randint(1, 5)), max_tokens=rng.randint(1, 6))
    sim.run()
    for r in sim.requests:
        # Every context fits the pool, so nobody is cut short.
        assert r.finish_reason == "length"
        assert r.output_token_ids == expected_outputs(r, r.params.max_tokens)


# -- chunked prefill ------------------------------------------------------------------------------


def test_long_prompt_is_chunked_and_chunks_add_up():
    sim = Sim(16, max_num_batched_tokens=8)
    r = sim.add(prompt(0, 21), max_tokens=2)
    chunks = []
    while not r.output_token_ids:
        out = sim.step()
        assert len(out.scheduled) == 1
        chunks.append(out.scheduled[0][1])
    assert chunks == [8, 8, 5] and sum(chunks) == 21
    assert r.num_computed_tokens == 21
    sim.run()
    assert r.output_token_ids == expected_outputs(r, 2)


def test_decodes_are_not_starved_by_a_long_prefill():
    sim = Sim(32, max_num_batched_tokens=8)
    a = sim.add(prompt(0, 3), max_tokens=20)
    b = sim.add(prompt(0, 3), max_tokens=20)
    sim.step()  # both prefilled
    long = sim.add(prompt(500, 40), max_tokens=1)
    chunks = []
    while not long.is_finished:
        out = sim.step()
        got = [(x.request_id, n) for x, n in out.scheduled]
        # Both decodes every step, first, and the long prompt gets what is left.
        assert got[:2] == [("r0", 1), ("r1", 1)]
        if len(got) == 3:
            assert got[2][0] == "r2" and got[2][1] <= 6
            chunks.append(got[2][1])
    assert sum(chunks) == 40 and len(chunks) == 7
    sim.run()
    assert a.output_token_ids == expected_outputs(a, 20)
    assert b.output_token_ids == expected_outputs(b, 20)


def test_prompt_chunk_fills_the_budget_left_after_decodes_then_next_prompt_starts():
    sim = Sim(32, max_num_batched_tokens=10)
    sim.add(prompt(0, 2), max_tokens=5)
    sim.step()
    sim.add(prompt(100, 6), max_tokens=2)
    sim.add(prompt(200, 6), max_tokens=2)
    out = sim.step()
    assert [(x.request_id, n) for x, n in out.scheduled] == [("r0", 1), ("r1", 6), ("r2", 3)]
    out = sim.step()
    assert [(x.request_id, n) for x, n in out.scheduled] == [("r0", 1), ("r1", 1), ("r2", 3)]
    sim.run()


# -- admission ------------------------------------------------------------------------------------


def test_fcfs_admission_by_seq_cap():
    sim = Sim(32, max_num_seqs=1, max_num_batched_tokens=16)
    for i in range(4):
        sim.add(prompt(100 * i, 4), max_tokens=2 + (3 - i))
    order = []
    while sim.scheduler.num_requests:
        sim.step()
        order += [r.request_id for r in sim.requests if r.is_finished and r.request_id not in order]
    assert order == ["r0", "r1", "r2", "r3"]
    sim.assert_whole()


def test_fcfs_small_request_does_not_overtake_a_blocked_head():
    sim = Sim(4, max_num_batched_tokens=32)
    a = sim.add(prompt(0, 9), max_tokens=3)  # 3 blocks
    b = sim.add(prompt(100, 6), max_tokens=2)  # 2 blocks: does not fit beside a
    c = sim.add(prompt(200, 2), max_tokens=2)  # 1 block: would fit, but b is first
    out = sim.step()
    assert [x.request_id for x, _ in out.scheduled] == ["r0"]
    assert list(sim.scheduler.waiting) == [b, c]
    while not a.is_finished:
        out = sim.step()
        assert c.status is RequestStatus.WAITING
    out = sim.step()
    assert [x.request_id for x, _ in out.scheduled] == ["r1", "r2"]
    sim.run()


def test_prefix_cache_hit_at_admission_skips_cached_tokens():
    sim = Sim(16, max_num_batched_tokens=32)
    shared = prompt(0, 8)
    a = sim.add(shared + [50, 51, 52], max_tokens=1)
    sim.run()
    assert a.num_cached_tokens == 0
    b = sim.add(shared + [60, 61, 62], max_tokens=2)
    out = sim.step()
    assert b.num_cached_tokens == 8
    assert [(x.request_id, n) for x, n in out.scheduled] == [("r1", 3)]
    sim.run()
    assert b.num_cached_tokens == 8
    # A prompt of exactly the cached blocks still computes its last token.
    c = sim.add(list(shared), max_tokens=1)
    out = sim.step()
    assert c.num_cached_tokens == 4 and [(x.request_id, n) for x, n in out.scheduled] == [("r2", 4)]
    sim.run()


def test_prefix_cache_hit_counts_against_the_budget_only_for_uncached_tokens():
    sim = Sim(16, max_num_batched_tokens=6)
    shared = prompt(0, 12)
    sim.add(shared + [1], max_tokens=1)
    sim.run()
    b = sim.add(shared + [2, 3, 4], max_tokens=1)
    c = sim.add(prompt(300, 3), max_tokens=1)
    out = sim.step()
    assert b.num_cached_tokens == 12
    assert [(x.request_id, n) for x, n in out.scheduled] == [("r1", 3), ("r2", 3)]
    sim.run()
    assert c.num_cached_tokens == 0


def test_prefix_caching_disabled_computes_everything():
    sim = Sim(16, enable_prefix_caching=False)
    sim.add(prompt(0, 9), max_tokens=1)
    sim.run()
    b = sim.add(prompt(0, 9), max_tokens=1)
    out = sim.step()
    assert b.num_cached_tokens == 0 and out.scheduled[0][1] == 9
    sim.run()


# -- preemption -----------------------------------------------------------------------------------


def test_preemption_by_recompute_when_blocks_run_out():
    sim = Sim(6, max_num_batched_tokens=64)
    a = sim.add(prompt(0, 8), max_tokens=6)  # 2 blocks
    b = sim.add(prompt(100, 7), max_tokens=6)  # 2 blocks
    c = sim.add(prompt(200, 7), max_tokens=6)  # 2 blocks: the pool is full
    late = sim.add(prompt(300, 2), max_tokens=2)  # waits: nothing left
    out = sim.step()
    assert [x.request_id for x, _ in out.scheduled] == ["r0", "r1", "r2"]
    assert sim.pool.num_free_blocks == 0
    # a's next token needs a third block: the latest arrival, c, gives its blocks back.
    out = sim.step()
    assert out.preempted == [c]
    assert [x.request_id for x, _ in out.scheduled] == ["r0", "r1"]
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert c.output_token_ids == expected_outputs(c, 1)  # its sampled token is kept
    assert c.num_tokens == 8
    assert sim.scheduler.waiting[0] is c and list(sim.scheduler.waiting) == [c, late]
    assert not sim.kv.holds("r2")
    assert c not in sim.scheduler.running
    sim.run()
    for r in (a, b, c, late):
        assert r.finish_reason == "length"
        assert r.output_token_ids == expected_outputs(r, r.params.max_tokens)
    assert c.num_preemptions >= 1
    assert sum(len(o.preempted) for o in sim.outputs) >= 1


def test_preempted_request_recomputes_prompt_and_outputs_and_keeps_num_cached_tokens():
    sim = Sim(5, max_num_batched_tokens=64, enable_prefix_caching=False)
    a = sim.add(prompt(0, 8), max_tokens=8)
    b = sim.add(prompt(100, 8), max_tokens=8)
    while not any(o.preempted for o in sim.outputs):
        sim.step()
    victim = sim.outputs[-1].preempted[0]
    assert victim is b
    kept = list(victim.output_token_ids)
    assert kept
    # When it is readmitted it computes prompt + kept outputs from scratch.
    while victim.status is RequestStatus.WAITING:
        out = sim.step()
    assert victim.output_token_ids[: len(kept)] == kept
    readmitted = [n for x, n in out.scheduled if x is victim]
    assert readmitted == [8 + len(kept)]
    assert victim.num_cached_tokens == 0
    sim.run()
    assert a.output_token_ids == expected_outputs(a, 8)
    assert b.output_token_ids == expected_outputs(b, 8)


def test_preempted_request_reuses_its_own_cached_blocks():
    sim = Sim(6, max_num_batched_tokens=64)
    sim.add(prompt(0, 8), max_tokens=12)
    b = sim.add(prompt(100, 8), max_tokens=12)
    while not any(o.preempted for o in sim.outputs):
        sim.step()
    assert sim.outputs[-1].preempted == [b]
    while b.status is RequestStatus.WAITING:
        num_tokens = b.num_tokens
        out = sim.step()
    (n,) = [n for x, n in out.scheduled if x is b]
    # Its head blocks were still cached in the free queue (its tail went first, to the other
    # request's growth): only the rest is recomputed.
    num_reused = num_tokens - n
    assert num_reused > 0 and num_reused % BS == 0
    assert b.num_cached_tokens == 0  # reported hits are the first admission's only
    sim.run()
    assert b.output_token_ids == expected_outputs(b, 12)


def test_many_requests_contend_for_a_tiny_pool_and_all_finish():
    sim = Sim(4, max_num_batched_tokens=16)
    for i in range(6):
        sim.add(prompt(100 * i, 3), max_tokens=9)  # 12 tokens: 3 of the 4 blocks each
    sim.run(max_steps=1000)
    assert sum(len(o.preempted) for o in sim.outputs) > 0
    for r in sim.requests:
        assert r.finish_reason == "length" and r.output_token_ids == expected_outputs(r, 9)


def test_context_that_can_never_fit_finishes_with_length():
    sim = Sim(3, max_num_batched_tokens=64)  # 12 tokens of cache
    r = sim.add(prompt(0, 10), max_tokens=100)
    sim.run(max_steps=50)
    assert r.finish_reason == "length"
    assert any(r in o.finished for o in sim.outputs)
    # 10 prompt tokens computed, then decodes up to 12 computed tokens: 3 tokens sampled.
    assert r.output_token_ids == expected_outputs(r, 3)


def test_context_that_can_never_fit_beside_others_finishes_and_others_go_on():
    sim = Sim(4, max_num_batched_tokens=64)
    big = sim.add(prompt(0, 6), max_tokens=100)
    small = sim.add(prompt(100, 2), max_tokens=3)
    sim.run(max_steps=100)
    assert big.finish_reason == "length" and len(big.output_token_ids) < 100
    assert small.output_token_ids == expected_outputs(small, 3)


def test_chunked_prompt_larger_than_the_pool_finishes_with_length():
    sim = Sim(3, max_num_batched_tokens=4)
    r = sim.add(prompt(0, 20), max_tokens=2)
    sim.run(max_steps=50)
    assert r.finish_reason == "length" and r.output_token_ids == []


def test_prompt_larger_than_the_pool_with_a_big_budget_does_not_hang():
    sim = Sim(2, max_num_batched_tokens=64)  # 8 tokens of cache
    r = sim.add(prompt(0, 12), max_tokens=2)
    after = sim.add(prompt(100, 2), max_tokens=2)
    sim.run(max_steps=50)
    assert r.finish_reason == "length"
    assert after.output_token_ids == expected_outputs(after, 2)


# -- abort ----------------------------------------------------------------------------------------


def assert_aborted(sim: Sim, request: Request) -> None:
    assert request.is_finished and request.finish_reason == "abort"
    assert not sim.kv.holds(request.request_id)
    assert request not in sim.scheduler.running and request not in sim.scheduler.waiting
    assert request.request_id not in sim.scheduler.awaiting_kv
    sim.pool.check_integrity()


def test_abort_while_waiting():
    sim = Sim(8, max_num_seqs=1)
    a = sim.add(prompt(0, 4), max_tokens=3)
    b = sim.add(prompt(100, 4), max_tokens=3)
    sim.step()
    assert b in sim.scheduler.waiting
    sim.scheduler.finish(b, "abort")
    assert_aborted(sim, b)
    sim.run()
    assert b.output_token_ids == [] and a.finish_reason == "length"


def test_abort_while_running():
    sim = Sim(8)
    a = sim.add(prompt(0, 6), max_tokens=10)
    b = sim.add(prompt(100, 6), max_tokens=10)
    sim.step()
    sim.step()
    assert sim.kv.holds("r0")
    sim.scheduler.finish(a, "abort")
    assert_aborted(sim, a)
    sim.run()
    assert len(a.output_token_ids) == 2
    assert b.output_token_ids == expected_outputs(b, 10)


def test_abort_while_partially_prefilled():
    sim = Sim(8, max_num_batched_tokens=4)
    a = sim.add(prompt(0, 14), max_tokens=2)
    sim.step()
    sim.step()
    assert a.num_computed_tokens == 8 and not a.output_token_ids
    assert len(sim.kv.block_table("r0")) == 2
    sim.scheduler.finish(a, "abort")
    assert_aborted(sim, a)
    # Its computed full blocks stay cached for whoever comes next.
    b = sim.add(prompt(0, 14), max_tokens=1)
    out = sim.step()
    assert b.num_cached_tokens == 8 and out.scheduled[0][1] == 4
    sim.run()


def test_abort_after_preemption():
    sim = Sim(6)
    sim.add(prompt(0, 8), max_tokens=6)
    sim.add(prompt(100, 7), max_tokens=6)
    c = sim.add(prompt(200, 7), max_tokens=6)
    sim.step()
    out = sim.step()
    assert out.preempted == [c]
    sim.scheduler.finish(c, "abort")
    assert_aborted(sim, c)
    sim.run()


def test_abort_awaiting_kv():
    sim = Sim(8)
    r = sim.add(prompt(0, 6), kv_role=KVRole.CONSUMER)
    sim.step()
    assert r.status is RequestStatus.WAITING_FOR_KV and sim.kv.holds("r0")
    sim.scheduler.finish(r, "abort")
    assert_aborted(sim, r)
    sim.assert_whole()


def test_abort_everything_midway_leaves_the_pool_whole():
    sim = Sim(6, max_num_seqs=3, max_num_batched_tokens=8)
    for i in range(6):
        sim.add(prompt(100 * i, 3 + 2 * i), max_tokens=6, kv_role=KVRole.CONSUMER if i == 4 else KVRole.LOCAL)
    for _ in range(4):
        sim.step()
    for r in sim.requests:
        if not r.is_finished:
            sim.scheduler.finish(r, "abort")
    assert sim.scheduler.num_requests == 0
    sim.assert_whole()


# -- decode role (KV from a peer) -------------------------------------------------------------------


def test_consumer_waits_for_kv_then_decodes():
    sim = Sim(8, max_num_batched_tokens=16)
    r = sim.add(prompt(0, 9), max_tokens=4, kv_role=KVRole.CONSUMER)
    out = sim.step()
    assert out.awaiting_kv == [r] and out.scheduled == []
    assert r.status is RequestStatus.WAITING_FOR_KV and sim.scheduler.awaiting_kv == {"r0": r}
    assert len(sim.kv.block_table("r0")) == sim.kv.num_blocks_for(9)
    assert r.num_computed_tokens == 0
    for _ in range(3):
        out = sim.step()
        assert out.is_empty
    assert r.num_computed_tokens == 0 and not r.output_token_ids
    assert sim.scheduler.kv_received("r0", 777) is r
    assert r.status is RequestStatus.RUNNING and r.num_computed_tokens == 9
    assert r.output_token_ids == [777]
    out = sim.step()
    assert [(x.request_id, n) for x, n in out.scheduled] == [("r0", 1)]
    sim.run()
    assert r.output_token_ids[0] == 777 and len(r.output_token_ids) == 4
    assert r.finish_reason == "length"


def test_consumer_prompt_blocks_are_cached_after_kv_received():
    sim = Sim(8)
    r = sim.add(prompt(0, 9), max_tokens=1, kv_role=KVRole.CONSUMER)
    sim.step()
    sim.scheduler.kv_received("r0", 5)
    assert sim.pool.num_cached_blocks == 2
    sim.scheduler.finish(r, "length")
    local = sim.add(prompt(0, 9), max_tokens=1)
    sim.step()
    assert local.num_cached_tokens == 8
    sim.run()


def test_consumer_with_prefix_hit_only_waits_for_the_rest():
    sim = Sim(8)
    sim.add(prompt(0, 8) + [1], max_tokens=1)
    sim.run()
    r = sim.add(prompt(0, 8) + [2, 3, 4], max_tokens=2, kv_role=KVRole.CONSUMER)
    out = sim.step()
    assert out.awaiting_kv == [r]
    assert r.num_cached_tokens == 8 and r.num_computed_tokens == 8
    assert len(sim.kv.block_table("r1")) == 3
    sim.run()
    assert len(r.output_token_ids) == 2


def test_consumer_waits_for_blocks_in_fcfs_order():
    sim = Sim(4)
    a = sim.add(prompt(0, 12), max_tokens=3)  # 3 blocks, 4 once it decodes
    r = sim.add(prompt(100, 8), max_tokens=2, kv_role=KVRole.CONSUMER)  # 2 blocks
    out = sim.step()
    assert out.awaiting_kv == [] and sim.scheduler.waiting[0] is r
    while r.status is RequestStatus.WAITING:
        assert not a.is_finished or sim.pool.all_free()
        out = sim.step()
    assert out.awaiting_kv == [r]
    sim.run()


def test_consumers_alongside_local_requests_all_finish():
    # max_num_seqs above the number of requests: see test_consumers_respect_max_num_seqs.
    sim = Sim(10, max_num_seqs=10, max_num_batched_tokens=10)
    for i in range(10):
        role = KVRole.CONSUMER if i % 3 == 0 else KVRole.LOCAL
        sim.add(prompt(100 * i, 2 + i), max_tokens=1 + i % 5, kv_role=role)
    sim.run()
    for r in sim.requests:
        assert r.finish_reason == "length" and len(r.output_token_ids) == r.params.max_tokens


def test_consumers_respect_max_num_seqs():
    sim = Sim(32, max_num_seqs=2, max_num_batched_tokens=4)
    for i in range(5):
        sim.add(prompt(100 * i, 4), max_tokens=3, kv_role=KVRole.CONSUMER)
    sim.step()
    assert len(sim.scheduler.awaiting_kv) + len(sim.scheduler.running) <= 2
    sim.run()  # asserts len(running) <= max_num_seqs after every step and kv_received


def _consumer(sim: Sim, tokens: list[int]) -> Request:
    """A consumer handed to ``admit_consumer`` (the decode hand-off's path) instead of ``add``."""
    request = Request(
        request_id=f"r{len(sim.requests)}",
        prompt_token_ids=tokens,
        params=SamplingParams(max_tokens=3),
        eos_token_ids=frozenset(),
        kv_role=KVRole.CONSUMER,
    )
    sim.requests.append(request)
    return request


def test_admit_consumer_gives_blocks_at_once_without_a_step():
    sim = Sim(8, max_num_seqs=2)
    local = sim.add(prompt(0, 8) + [1], max_tokens=6)
    sim.step()  # the local request runs; its first block is cached
    r = _consumer(sim, prompt(0, 8) + [2, 3])
    assert sim.scheduler.admit_consumer(r)
    assert r.status is RequestStatus.WAITING_FOR_KV and sim.scheduler.awaiting_kv == {r.request_id: r}
    assert r.num_cached_tokens == 8 and len(sim.kv.block_table(r.request_id)) == 3
    sim.pool.check_integrity()
    out = sim.step()  # the next step does not list it again: its caller already has its blocks
    assert out.awaiting_kv == [] and [x for x, _ in out.scheduled] == [local]
    sim.run()  # Sim delivers its KV; it decodes to the end and the pool ends whole


def test_admit_consumer_queues_behind_waiting_requests_and_full_seats():
    sim = Sim(8, max_num_seqs=1)
    first = _consumer(sim, prompt(0, 5))
    assert sim.scheduler.admit_consumer(first)
    second = _consumer(sim, prompt(100, 5))
    assert not sim.scheduler.admit_consumer(second)  # no seat: waits
    third = _consumer(sim, prompt(200, 5))
    assert not sim.scheduler.admit_consumer(third)
    assert list(sim.scheduler.waiting) == [second, third] and not sim.kv.holds(second.request_id)
    sim.pool.check_integrity()
    sim.run()
    assert all(len(r.output_token_ids) == 3 for r in (first, second, third))
