"""Tenant isolation of the prefix cache: a request shares cached blocks only with requests of
its own ``cache_salt``, in the block hashes, in the pool's verification of a hit (even under a
degenerate hasher), and in a real engine's hit counts."""

from __future__ import annotations

import pytest

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import KVRole
from pdserve.types.cache_salt import salt_root
from pdserve.types.engine_config import EngineConfig
from pdserve.types.sampling_params import SamplingParams

BS = 4
PROMPT = list(range(3, 3 + 3 * BS + 1))  # three full blocks and one more token


def _cache(kv: KVCacheManager, request_id: str, token_ids: list[int], salt: str | None) -> None:
    assert kv.allocate(request_id, len(token_ids))
    kv.cache_full_blocks(request_id, token_ids, len(token_ids), salt)
    kv.free(request_id)
    kv.pool.check_integrity()


def test_salt_roots_differ_by_salt_and_none_is_unsalted():
    assert salt_root(None) is None and salt_root("") is None
    assert salt_root("a") == salt_root("a") != salt_root("b")


@pytest.mark.parametrize("cached_under", [None, "tenant-a"])
def test_a_prefix_is_found_only_under_the_salt_it_was_cached_under(cached_under):
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    _cache(kv, "a", PROMPT, cached_under)
    assert len(kv.find_cached_prefix(PROMPT, cached_under)) == 3
    for other in {None, "tenant-a", "tenant-b", "tenant-a/x"} - {cached_under}:
        assert kv.find_cached_prefix(PROMPT, other) == []
    assert pool.all_free()


def test_a_colliding_hash_never_serves_one_salts_first_block_to_another():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS, hasher=lambda parent, token_ids: b"same")  # every block collides
    _cache(kv, "a", PROMPT[: BS + 1], "tenant-a")
    assert kv.find_cached_prefix(PROMPT, "tenant-a") == [pool._cached[b"same"]]
    assert kv.find_cached_prefix(PROMPT, "tenant-b") == []
    assert kv.find_cached_prefix(PROMPT, None) == []
    assert pool.all_free()


@pytest.fixture(scope="module")
def engine(checkpoints):
    path, _ = checkpoints("llama")
    return LLMEngine(str(path), EngineConfig(kv_cache_memory=2**20))


def _cached_tokens(engine: LLMEngine, request_id: str, salt: str | None, role: KVRole = KVRole.LOCAL) -> int:
    prompt = list(range(5, 5 + 3 * 16 + 1))  # three full blocks of 16
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request(
        request_id, prompt, params, role, pin_s=30.0 if role is KVRole.PRODUCER else None, cache_salt=salt
    )
    while True:
        final = next((o for o in engine.step().outputs if o.finished), None)
        if final is not None:
            if role is KVRole.PRODUCER:
                assert engine.release_pin(request_id)
            engine.check_idle_integrity()
            assert engine.block_pool.all_free()
            return final.num_cached_tokens


@pytest.mark.parametrize("role", [KVRole.LOCAL, KVRole.PRODUCER])
def test_the_engine_hits_only_its_own_salts_cache(engine, role):
    engine.block_pool.reset_prefix_cache()
    assert _cached_tokens(engine, "a1", "tenant-a", role) == 0
    assert _cached_tokens(engine, "b1", "tenant-b", role) == 0  # a's prompt cached, b's salt misses it
    assert _cached_tokens(engine, "n1", None, role) == 0  # and so does an unsalted request
    assert _cached_tokens(engine, "a2", "tenant-a", role) == 48
    assert _cached_tokens(engine, "b2", "tenant-b", role) == 48
    assert _cached_tokens(engine, "n2", None, role) == 48
