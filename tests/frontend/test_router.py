"""Router decisions on hand-made registry entries (no processes needed)."""

from __future__ import annotations

import pytest

from pdserve.discovery.knobs import Knobs
from pdserve.discovery.registry import WorkerEntry
from pdserve.frontend.config import RouterConfig
from pdserve.frontend.kv_fit import KVMisfit
from pdserve.frontend.prefix_index import PrefixIndex, block_hashes
from pdserve.frontend.router import NoWorker, Router
from pdserve.types.engine_load import EngineLoad


def entry(
    worker_id: str, role: str, draining: bool = False, tp: int = 1, kv_heads: int = 0, **load: int
) -> WorkerEntry:
    return WorkerEntry(
        worker_id=worker_id,
        role=role,
        model="m",
        model_path="/m",
        endpoint=f"{worker_id}:1",
        nixl=b"",
        block_size=4,
        num_kv_blocks=100,
        max_model_len=1024,
        vocab_size=100,
        max_num_seqs=8,
        started_at=0.0,
        load=EngineLoad(kv_blocks_total=100, **load),
        draining=draining,
        tensor_parallel_size=tp,
        num_kv_heads=kv_heads,
    )


def test_decode_goes_to_the_least_loaded_and_skips_draining_workers():
    router = Router(RouterConfig(), seed=0)
    busy = entry("d1", "decode", running=6, kv_blocks_used=50)
    idle = entry("d2", "decode", running=1, kv_blocks_used=5)
    draining = entry("d3", "decode", draining=True)
    assert router.choose_decode([busy, idle, draining]).worker_id == "d2"
    assert router.choose_decode([busy, idle], exclude=["d2"]).worker_id == "d1"
    with pytest.raises(NoWorker):
        router.choose_decode([draining])


def test_requests_dispatched_since_the_last_load_report_count():
    router = Router(RouterConfig(), seed=0)
    d1, d2 = entry("d1", "decode"), entry("d2", "decode")
    for _ in range(3):
        router.decode_started(d1)
    assert router.choose_decode([d1, d2]).worker_id == "d2"
    for _ in range(3):
        router.decode_done(d1)
    router.decode_started(d2)
    assert router.choose_decode([d1, d2]).worker_id == "d1"


def test_prefill_follows_the_cached_prefix_unless_that_worker_is_swamped():
    router = Router(RouterConfig(disaggregation="always"), seed=0)
    p1, p2 = entry("p1", "prefill"), entry("p2", "prefill")
    prompt = list(range(40))
    first = router.choose_prefill([p1, p2], prompt)
    router.prefill_started(first, len(prompt))
    router.prefill_done(first, len(prompt))
    again = router.choose_prefill([p1, p2], prompt + [7, 8, 9])
    assert again.worker.worker_id == first.worker.worker_id and again.cached_tokens == 40
    other = p2 if first.worker.worker_id == "p1" else p1
    swamped = entry(first.worker.worker_id, "prefill", queued_prefill_tokens=500)
    assert router.choose_prefill([swamped, other], prompt).worker.worker_id == other.worker_id


def test_conditional_disaggregation_keeps_short_uncached_prompts_on_the_decode_worker():
    router = Router(
        RouterConfig(disaggregation="conditional", local_prefill_threshold_tokens=16, prefill_saturation_tokens=100)
    )
    p1 = entry("p1", "prefill")
    assert router.choose_prefill([p1], list(range(16))) is None
    assert router.choose_prefill([p1], list(range(17))).worker.worker_id == "p1"
    assert router.choose_prefill([], list(range(500))) is None  # no prefill pool: prefill locally
    saturated = entry("p1", "prefill", queued_prefill_tokens=100)
    assert router.choose_prefill([saturated], list(range(500))) is None


def test_live_knobs_set_the_local_prefill_threshold_in_place_of_the_config():
    router = Router(RouterConfig(disaggregation="conditional", local_prefill_threshold_tokens=16))
    p1, prompt = entry("p1", "prefill"), list(range(40))
    assert router.choose_prefill([p1], prompt) is not None
    assert router.choose_prefill([p1], prompt, knobs=Knobs(local_prefill_threshold_tokens=64)) is None
    assert router.choose_prefill([p1], list(range(10)), knobs=Knobs(local_prefill_threshold_tokens=0)) is not None
    always = Router(RouterConfig(disaggregation="always"))
    assert always.choose_prefill([p1], prompt, knobs=Knobs(local_prefill_threshold_tokens=64)) is not None


def test_decode_occupancy_counts_against_the_batch_limit_in_force():
    router = Router(RouterConfig(), seed=0)
    # Of a start-up limit of 8, d1 runs 2 and d2 runs 3; but d1's live knobs allow it only 2: it is full.
    full = entry("d1", "decode", running=2, max_num_seqs=2)
    roomy = entry("d2", "decode", running=3)
    assert router.choose_decode([full, roomy]).worker_id == "d2"


def test_always_and_off_force_either_way():
    p1 = entry("p1", "prefill")
    assert Router(RouterConfig(disaggregation="always")).choose_prefill([p1], [1, 2]).worker.worker_id == "p1"
    assert Router(RouterConfig(disaggregation="off")).choose_prefill([p1], list(range(500))) is None
    with pytest.raises(NoWorker):
        Router(RouterConfig(disaggregation="always")).choose_prefill([], [1, 2])


def test_bad_router_config_names_the_field():
    with pytest.raises(ValueError, match="disaggregation"):
        RouterConfig(disaggregation="sometimes")
    with pytest.raises(ValueError, match="local_prefill_threshold_tokens"):
        RouterConfig(local_prefill_threshold_tokens=-1)


def test_prefix_index_is_chained_and_bounded():
    index = PrefixIndex()
    a = block_hashes(list(range(12)), 4)
    b = block_hashes([99] + list(range(1, 12)), 4)  # differs in the first block only
    assert len(a) == 3 and not set(a) & set(b)  # chained: a change early changes every later hash
    index.record("w", a, capacity_blocks=4)
    assert index.overlap("w", a) == 3 and index.overlap("w", b) == 0
    index.record("w", b, capacity_blocks=4)  # evicts the least recently used two of a's blocks
    assert index.overlap("w", a) == 0 and index.overlap("w", b) == 3
    index.forget("w")
    assert index.overlap("w", b) == 0


def test_the_prefix_index_matches_a_prompt_only_under_its_own_cache_salt():
    tokens = list(range(13))
    unsalted, a, b = (block_hashes(tokens, 4, salt) for salt in (None, "tenant-a", "tenant-b"))
    assert unsalted == block_hashes(tokens, 4) and block_hashes(tokens, 4, "tenant-a") == a
    assert len(a) == 3 and not set(a) & set(b) and not set(a) & set(unsalted)
    # Tenant a's prompt went to p1; the same prompt from b (or unsalted) finds nothing cached there,
    # so its routing cannot tell that a sent it, while a's next one is sent back to p1's cache.
    router = Router(RouterConfig(disaggregation="always"), seed=0)
    workers = [entry("p1", "prefill"), entry("p2", "prefill")]
    first = router.choose_prefill(workers, tokens, cache_salt="tenant-a")
    assert first is not None and first.cached_tokens == 0
    router.prefill_started(first, len(tokens))
    router.prefill_done(first, len(tokens))
    for other in ("tenant-b", None):
        for _ in range(8):
            choice = router.choose_prefill(workers, tokens, cache_salt=other)
            assert choice is not None and choice.cached_tokens == 0
    again = router.choose_prefill(workers, tokens, cache_salt="tenant-a")
    assert again is not None and again.worker.worker_id == first.worker.worker_id and again.cached_tokens == 12


def test_prefill_workers_whose_kv_heads_cannot_reach_the_decode_group_are_skipped_or_refused():
    router = Router(RouterConfig(disaggregation="always"), seed=0)
    decode = entry("d1", "decode", tp=2, kv_heads=4)
    fits = [entry("p1", "prefill", tp=1, kv_heads=4), entry("p4", "prefill", tp=4, kv_heads=4)]
    for prefill in fits:  # 4 heads over 1 or 4 prefill ranks and 2 decode ranks
        assert router.choose_prefill([prefill], [1, 2, 3], decode=decode).worker.worker_id == prefill.worker_id
    # 4 heads do not divide over 3 ranks; another prefill worker that fits takes the request.
    odd = entry("p3", "prefill", tp=3, kv_heads=4, queued_prefill_tokens=0)
    busy_fit = entry("p1", "prefill", tp=1, kv_heads=4, queued_prefill_tokens=500)
    assert router.choose_prefill([odd, busy_fit], [1, 2, 3], decode=decode).worker.worker_id == "p1"
    with pytest.raises(KVMisfit, match="4 KV heads do not divide over prefill worker p3's tensor-parallel size 3"):
        router.choose_prefill([odd], [1, 2, 3], decode=decode)
    with pytest.raises(KVMisfit, match="prefill worker p1 has 4 KV heads, decode worker d1 2"):
        router.choose_prefill([fits[0]], [1, 2, 3], decode=entry("d1", "decode", tp=2, kv_heads=2))
    # MLA (0 KV heads: the latent is whole on every rank) fits any sizes.
    mla_decode = entry("d2", "decode", tp=2)
    assert router.choose_prefill([entry("p0", "prefill", tp=3)], [1, 2, 3], decode=mla_decode) is not None
