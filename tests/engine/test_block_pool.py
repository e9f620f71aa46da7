"""BlockPool: reference counts, the LRU free queue, and the verified prefix cache."""

import pytest

from pdserve.engine.block_pool import BlockPool, hash_block
from pdserve.engine.kv_cache_manager import KVCacheManager

BS = 4


def tokens(start: int, n: int = BS) -> list[int]:
    return list(range(start, start + n))


def free_order(pool: BlockPool) -> list[int]:
    """The free queue, front (evicted first) to back."""
    return list(pool._free)


def cache_block(pool: BlockPool, block_id: int, parent: bytes | None, token_ids: list[int]) -> bytes:
    block_hash = hash_block(parent, token_ids)
    pool.cache(block_id, block_hash, token_ids, None)
    pool.check_integrity()
    return block_hash


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_acquire_release_reference_counts():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4 and pool.all_free() and pool.usage == 0.0
    a, b = pool.allocate(2)
    pool.check_integrity()
    assert {a, b} == {0, 1}
    assert pool.blocks[a].ref_count == 1 and pool.blocks[b].ref_count == 1
    assert pool.num_free_blocks == 2 and pool.usage == 0.5 and not pool.all_free()

    pool.acquire([a])
    pool.check_integrity()
    assert pool.blocks[a].ref_count == 2
    assert pool.num_free_blocks == 2  # already in use: acquiring takes nothing from the free queue

    pool.release([a])
    pool.check_integrity()
    assert pool.blocks[a].ref_count == 1 and a not in free_order(pool)
    pool.release([a, b])
    pool.check_integrity()
    assert pool.blocks[a].ref_count == 0 and pool.blocks[b].ref_count == 0
    assert pool.all_free()


def test_release_more_than_acquired_raises():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.release([a])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([a])
    pool.check_integrity()
    assert pool.blocks[a].ref_count == 0 and pool.all_free()


def test_release_never_acquired_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.release([1])
    pool.check_integrity()
    assert pool.all_free()


def test_allocate_more_than_free_raises_without_side_effects():
    pool = BlockPool(3)
    held = pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    pool.check_integrity()
    assert pool.num_free_blocks == 1
    pool.release(held)
    pool.check_integrity()
    assert pool.all_free()


def test_allocate_zero_blocks():
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    pool.check_integrity()
    assert pool.all_free()


def test_blocks_freed_earlier_are_evicted_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    # Free in the order 2, 0, 3, 1: that is the eviction order.
    for block_id in (2, 0, 3, 1):
        pool.release([block_id])
        pool.check_integrity()
    assert free_order(pool) == [2, 0, 3, 1]
    for block_id, parent in zip(blocks, (None, b"x", b"y", b"z")):
        cache_block(pool, block_id, parent, tokens(10 * block_id))
    assert pool.num_cached_blocks == 4
    assert pool.allocate(1) == [2]
    pool.check_integrity()
    assert pool.blocks[2].block_hash is None and pool.num_cached_blocks == 3
    assert pool.allocate(2) == [0, 3]
    pool.check_integrity()
    assert pool.num_cached_blocks == 1 and pool.blocks[1].block_hash is not None
    pool.release([2, 0, 3])
    pool.check_integrity()
    assert pool.all_free()


def test_request_tail_blocks_are_evicted_before_head_blocks():
    pool = BlockPool(6)
    kv = KVCacheManager(pool, BS)
    prompt = tokens(0, 3 * BS)
    assert kv.allocate("r", len(prompt))
    table = list(kv.block_table("r"))
    assert table == [0, 1, 2]
    kv.cache_full_blocks("r", prompt, len(prompt))
    pool.check_integrity()
    assert pool.num_cached_blocks == 3
    kv.free("r")
    pool.check_integrity()
    assert pool.all_free()
    # Never-used blocks first, then the request's blocks tail to head.
    assert free_order(pool) == [3, 4, 5, 2, 1, 0]
    assert kv.find_cached_prefix(prompt + [99]) == [0, 1, 2]

    # Taking four fresh blocks evicts only the tail block: the head of the prefix survives.
    assert kv.allocate("other", 4 * BS)
    pool.check_integrity()
    assert sorted(kv.block_table("other")) == [2, 3, 4, 5]
    assert pool.blocks[2].block_hash is None
    assert kv.find_cached_prefix(prompt + [99]) == [0, 1]
    assert kv.allocate("other", 5 * BS)
    pool.check_integrity()
    assert kv.block_table("other")[-1] == 1
    assert kv.find_cached_prefix(prompt + [99]) == [0]
    kv.free("other")
    pool.check_integrity()
    assert pool.all_free()


def test_cached_free_block_is_reused_on_lookup_and_leaves_the_free_queue():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    h = cache_block(pool, a, None, tokens(0))
    pool.release([a])
    pool.check_integrity()
    assert a in free_order(pool) and pool.num_cached_blocks == 1

    assert pool.lookup(h, tokens(0), None) == a
    pool.acquire([a])
    pool.check_integrity()
    assert a not in free_order(pool)
    assert pool.blocks[a].ref_count == 1 and pool.num_free_blocks == 2
    # Still cached while in use, and a second user shares it.
    assert pool.lookup(h, tokens(0), None) == a
    pool.acquire([a])
    assert pool.blocks[a].ref_count == 2
    # Fresh allocations never take a referenced block, cached or not.
    others = pool.allocate(2)
    pool.check_integrity()
    assert a not in others
    pool.release([a, a] + others)
    pool.check_integrity()
    # The free queue was empty; the shared block reached zero first, so it is evicted first.
    assert free_order(pool)[0] == a
    assert pool.all_free()


def test_reacquired_block_moves_to_the_back_of_the_free_queue():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for block_id in blocks:
        cache_block(pool, block_id, bytes([block_id]), tokens(block_id * 10))
    pool.release(blocks)
    assert free_order(pool) == [0, 1, 2]
    # A prefix hit on block 0 then its release: it is now the most recently used.
    pool.acquire([0])
    pool.release([0])
    pool.check_integrity()
    assert free_order(pool) == [1, 2, 0]
    assert pool.allocate(1) == [1]
    pool.release([1])
    pool.check_integrity()
    assert pool.all_free()


def test_lookup_misses_on_unknown_hash_and_on_token_mismatch():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    h = cache_block(pool, a, None, tokens(0))
    assert pool.lookup(hash_block(None, tokens(1)), tokens(1), None) is None
    # Same hash, different tokens: a collision must never be served.
    assert pool.lookup(h, tokens(1), None) is None
    assert pool.lookup(h, tokens(0, BS - 1), None) is None
    assert pool.lookup(h, tokens(0), None) == a
    pool.release([a])
    pool.check_integrity()
    assert pool.all_free()


def test_degenerate_hasher_never_gives_a_false_hit():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS, hasher=lambda parent, token_ids: b"same")
    first = tokens(0, 2 * BS) + [100]
    assert kv.allocate("a", len(first))
    kv.cache_full_blocks("a", first, len(first))
    pool.check_integrity()
    # Every block hashes alike, so only one can hold the hash.
    assert pool.num_cached_blocks == 1
    kv.free("a")
    pool.check_integrity()

    other = tokens(50, 2 * BS) + [100]
    assert kv.find_cached_prefix(other) == []
    # A true hit still works: the first block's tokens match.
    assert kv.find_cached_prefix(tokens(0, BS) + tokens(70, BS) + [1]) == [0]
    assert pool.all_free()


def test_cache_keeps_the_first_block_for_a_hash():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    h = cache_block(pool, a, None, tokens(0))
    pool.cache(b, h, tokens(0), None)  # the same prefix computed twice
    pool.check_integrity()
    assert pool.lookup(h, tokens(0), None) == a and pool.blocks[b].block_hash is None
    # Caching an already cached block under a new hash changes nothing.
    pool.cache(a, hash_block(None, tokens(5)), tokens(5), None)
    pool.check_integrity()
    assert pool.lookup(h, tokens(0), None) == a and pool.num_cached_blocks == 1
    pool.release([a, b])
    pool.check_integrity()
    assert pool.all_free()


def test_reset_prefix_cache():
    pool = BlockPool(4)
    in_use, freed = pool.allocate(2)
    h_used = cache_block(pool, in_use, None, tokens(0))
    h_freed = cache_block(pool, freed, h_used, tokens(4))
    pool.release([freed])
    pool.reset_prefix_cache()
    pool.check_integrity()
    assert pool.num_cached_blocks == 0
    assert pool.lookup(h_used, tokens(0), None) is None
    assert pool.lookup(h_freed, tokens(4), None) is None
    # Blocks in use keep their references; the free queue is untouched.
    assert pool.blocks[in_use].ref_count == 1 and pool.num_free_blocks == 3
    # The pool caches again afterwards.
    cache_block(pool, in_use, None, tokens(0))
    assert pool.lookup(h_used, tokens(0), None) == in_use
    pool.release([in_use])
    pool.check_integrity()
    assert pool.all_free()


def test_prefix_caching_disabled_caches_nothing():
    pool = BlockPool(4, enable_prefix_caching=False)
    kv = KVCacheManager(pool, BS)
    prompt = tokens(0, 3 * BS) + [1]
    assert kv.allocate("r", len(prompt))
    kv.cache_full_blocks("r", prompt, len(prompt))
    pool.check_integrity()
    assert pool.num_cached_blocks == 0
    assert all(b.block_hash is None for b in pool.blocks)
    h = hash_block(None, tokens(0))
    pool.cache(0, h, tokens(0), None)
    assert pool.lookup(h, tokens(0), None) is None
    kv.free("r")
    assert kv.find_cached_prefix(prompt) == []
    pool.check_integrity()
    assert pool.all_free()


def test_hash_block_is_chained_and_stable():
    h1 = hash_block(None, [1, 2, 3, 4])
    assert h1 == hash_block(None, (1, 2, 3, 4))
    assert len(h1) == 16
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    # Token boundaries matter: ints are hashed at fixed width.
    assert hash_block(None, [1, 2]) != hash_block(None, [258])


def test_check_integrity_catches_corruption():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool._free[a] = None  # referenced and free at once
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_degenerate_hasher_same_tokens_after_another_parent_is_no_hit():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS, hasher=lambda parent, token_ids: b"same")
    first = tokens(0, BS) + tokens(50, BS) + [100]
    assert kv.allocate("a", len(first))
    kv.cache_full_blocks("a", first, len(first))
    kv.free("a")
    pool.check_integrity()
    # Block 0 holds tokens(0) at position 0 with no parent. The second block below holds the
    # same tokens after a parent, so its KV differs; only the first block is a true hit.
    repeated = tokens(0, BS) + tokens(0, BS) + [1]
    try:
        assert kv.find_cached_prefix(repeated) == [0]
    finally:
        pool.check_integrity()
        assert pool.all_free()
