"""KVCacheManager: per-request block tables, prefix lookup, and the free-queue accounting."""

import pytest

from pdserve.engine.block_pool import BlockPool, hash_block
from pdserve.engine.kv_cache_manager import KVCacheManager

BS = 4


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def manager(num_blocks: int, **kwargs) -> tuple[BlockPool, KVCacheManager]:
    pool = BlockPool(num_blocks, **kwargs)
    return pool, KVCacheManager(pool, BS)


def compute(kv: KVCacheManager, request_id: str, token_ids: list[int], cached: list[int] = ()) -> None:
    """Allocate a request's blocks for all of ``token_ids`` and mark them computed."""
    assert kv.allocate(request_id, len(token_ids), cached)
    kv.cache_full_blocks(request_id, token_ids, len(token_ids))
    kv.pool.check_integrity()


def test_num_blocks_for():
    _, kv = manager(2)
    assert [kv.num_blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_prompt_of_whole_blocks_never_serves_its_last_token(k):
    pool, kv = manager(8)
    prompt = tokens(0, k * BS)
    compute(kv, "a", prompt + [7])  # every block of the prompt is now cached
    kv.free("a")
    assert pool.num_cached_blocks == k
    # Exactly k full blocks: the last one holds the last token, so only k - 1 may be served.
    hit = kv.find_cached_prefix(prompt)
    assert len(hit) == k - 1
    assert len(hit) * BS < len(prompt)
    # One more token: all k blocks are served and the model runs on the last one.
    assert len(kv.find_cached_prefix(prompt + [9])) == k
    pool.check_integrity()
    assert pool.all_free()


def test_find_cached_prefix_edge_lengths():
    pool, kv = manager(8)
    compute(kv, "a", tokens(0, 3 * BS))
    kv.free("a")
    for n in range(0, 3 * BS + 1):
        hit = kv.find_cached_prefix(tokens(0, n))
        assert len(hit) == max(0, (n - 1) // BS), n
        assert len(hit) * BS <= max(0, n - 1)
    pool.check_integrity()
    assert pool.all_free()


def test_find_cached_prefix_stops_at_first_miss():
    pool, kv = manager(8)
    prompt = tokens(0, 3 * BS) + [1]
    compute(kv, "a", prompt)
    kv.free("a")
    changed = list(prompt)
    changed[BS + 1] = 999  # second block differs; the third is then a different prefix too
    assert kv.find_cached_prefix(changed) == [kv.find_cached_prefix(prompt)[0]]
    assert kv.find_cached_prefix([999] + prompt[1:]) == []
    pool.check_integrity()
    assert pool.all_free()


def test_hashes_are_chained_same_block_under_another_parent_misses():
    pool, kv = manager(8)
    a, b, c = tokens(0, BS), tokens(10, BS), tokens(20, BS)
    compute(kv, "r1", a + b + [1])
    kv.free("r1")
    assert len(kv.find_cached_prefix(a + b + [1])) == 2
    # Block b under parent c is another prefix: no hit for it, nor for anything after.
    assert kv.find_cached_prefix(c + b + [1]) == []
    assert kv.find_cached_prefix(b + [1]) == []
    # The chained hash is what the pool stores.
    h_a = hash_block(None, a)
    block_a = pool.lookup(h_a, a, None)
    assert block_a is not None
    assert pool.lookup(hash_block(h_a, b), b, block_a) is not None
    assert pool.lookup(hash_block(h_a, b), b, None) is None  # right hash, wrong parent
    assert pool.lookup(hash_block(None, b), b, None) is None
    pool.check_integrity()
    assert pool.all_free()


def test_two_requests_share_a_cached_prefix():
    pool, kv = manager(6)
    shared = tokens(0, 2 * BS)
    compute(kv, "a", shared + [1])
    hit = kv.find_cached_prefix(shared + tokens(50, 3))
    assert hit == kv.block_table("a")[:2]
    compute(kv, "b", shared + tokens(50, 3), hit)
    assert kv.block_table("b")[:2] == hit
    assert all(pool.blocks[x].ref_count == 2 for x in hit)
    # 3 blocks for a, 1 more for b
    assert pool.num_free_blocks == 6 - 4
    kv.free("a")
    pool.check_integrity()
    assert all(pool.blocks[x].ref_count == 1 for x in hit)
    kv.free("b")
    pool.check_integrity()
    assert pool.all_free()


def test_can_allocate_counts_cached_blocks_in_the_free_queue():
    pool, kv = manager(4)
    prefix = tokens(0, 2 * BS)
    compute(kv, "a", prefix)
    kv.free("a")
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    hit = kv.find_cached_prefix(prefix + [1])
    assert len(hit) == 2
    # 4 blocks of tokens: the 2 cached ones come out of the free queue too, so 4 are used.
    assert kv.can_allocate("b", 4 * BS, hit)
    assert not kv.can_allocate("b", 4 * BS + 1, hit)
    # The same with the cached blocks still held by another request: they cost nothing.
    compute(kv, "a", prefix, kv.find_cached_prefix(prefix + [1]))
    assert kv.block_table("a") == hit and pool.num_free_blocks == 2
    assert kv.can_allocate("b", 4 * BS, hit)
    assert not kv.can_allocate("b", 4 * BS + 1, hit)
    assert kv.allocate("b", 4 * BS, hit)
    pool.check_integrity()
    assert pool.num_free_blocks == 0
    kv.free("a")
    kv.free("b")
    pool.check_integrity()
    assert pool.all_free()


def test_can_allocate_accounts_for_blocks_already_held():
    pool, kv = manager(3)
    assert kv.allocate("a", 2 * BS)
    assert kv.can_allocate("a", 3 * BS)
    assert not kv.can_allocate("a", 3 * BS + 1)
    assert kv.can_allocate("a", 2 * BS)  # nothing new needed
    assert kv.allocate("a", BS)  # shrinking asks for nothing and changes nothing
    assert len(kv.block_table("a")) == 2
    kv.free("a")
    pool.check_integrity()
    assert pool.all_free()


def test_allocate_grows_the_table_in_place():
    pool, kv = manager(4)
    assert kv.allocate("a", 1)
    first = list(kv.block_table("a"))
    assert len(first) == 1
    assert kv.allocate("a", BS)  # still fits the first block
    assert kv.block_table("a") == first
    assert kv.allocate("a", BS + 1)
    assert kv.block_table("a")[:1] == first and len(kv.block_table("a")) == 2
    pool.check_integrity()
    kv.free("a")
    assert pool.all_free()


def test_allocate_fails_without_side_effects_when_full():
    pool, kv = manager(4)
    prefix = tokens(0, 2 * BS)
    compute(kv, "a", prefix)
    kv.free("a")
    assert kv.allocate("x", BS)  # one block taken, three free (two cached)
    hit = kv.find_cached_prefix(prefix + [1])
    before = (
        pool.num_free_blocks,
        pool.num_cached_blocks,
        list(pool._free),
        [(b.ref_count, b.block_hash) for b in pool.blocks],
    )
    assert not kv.allocate("b", 3 * BS + 1, hit)
    assert not kv.allocate("x", 5 * BS)
    after = (
        pool.num_free_blocks,
        pool.num_cached_blocks,
        list(pool._free),
        [(b.ref_count, b.block_hash) for b in pool.blocks],
    )
    assert before == after
    assert not kv.holds("b") and kv.block_table("b") == []
    assert len(kv.block_table("x")) == 1
    pool.check_integrity()
    # It fits with one token fewer.
    assert kv.allocate("b", 3 * BS, hit)
    pool.check_integrity()
    kv.free("b")
    kv.free("x")
    pool.check_integrity()
    assert pool.all_free()


def test_free_releases_everything_and_is_idempotent():
    pool, kv = manager(5)
    compute(kv, "a", tokens(0, 9))
    compute(kv, "b", tokens(0, 9), kv.find_cached_prefix(tokens(0, 9)))
    assert kv.holds("a") and kv.holds("b")
    kv.free("a")
    kv.free("b")
    assert not kv.holds("a") and not kv.holds("b")
    assert kv.block_table("a") == []
    pool.check_integrity()
    assert pool.all_free()
    kv.free("a")  # nothing held: nothing to release
    kv.free("never-seen")
    pool.check_integrity()
    assert pool.all_free()


def test_cache_full_blocks_is_incremental_and_skips_partial_blocks():
    pool, kv = manager(4)
    token_ids = tokens(0, 3 * BS)
    assert kv.allocate("a", len(token_ids))
    kv.cache_full_blocks("a", token_ids, BS - 1)
    assert pool.num_cached_blocks == 0  # a partial block is never shared
    kv.cache_full_blocks("a", token_ids, BS + 2)
    assert pool.num_cached_blocks == 1
    kv.cache_full_blocks("a", token_ids, 3 * BS)
    assert pool.num_cached_blocks == 3
    kv.cache_full_blocks("a", token_ids, 3 * BS)
    assert pool.num_cached_blocks == 3
    pool.check_integrity()
    table = kv.block_table("a")
    assert kv.find_cached_prefix(token_ids + [0]) == table
    kv.free("a")
    pool.check_integrity()
    assert pool.all_free()


def test_chunked_computation_caches_the_same_hashes_as_one_shot():
    token_ids = tokens(0, 4 * BS)
    one_pool, one = manager(8)
    one.allocate("a", len(token_ids))
    one.cache_full_blocks("a", token_ids, len(token_ids))
    chunk_pool, chunked = manager(8)
    for n in (3, 5, 11, 16):
        chunked.allocate("a", n)
        chunked.cache_full_blocks("a", token_ids, n)
    assert set(one_pool._cached) == set(chunk_pool._cached)
    assert len(chunk_pool._cached) == 4
    one.free("a")
    chunked.free("a")
    for pool in (one_pool, chunk_pool):
        pool.check_integrity()
        assert pool.all_free()


def test_a_freed_request_recomputes_its_hashes_from_scratch():
    pool, kv = manager(4)
    token_ids = tokens(0, 2 * BS)
    compute(kv, "a", token_ids)
    kv.free("a")
    pool.reset_prefix_cache()
    # The same id again: its hash chain starts over instead of reusing stale state.
    compute(kv, "a", token_ids)
    assert pool.num_cached_blocks == 2
    assert kv.find_cached_prefix(token_ids + [1]) == kv.block_table("a")
    kv.free("a")
    pool.check_integrity()
    assert pool.all_free()


def test_prefix_caching_disabled():
    pool, kv = manager(4, enable_prefix_caching=False)
    compute(kv, "a", tokens(0, 2 * BS))
    kv.free("a")
    assert kv.find_cached_prefix(tokens(0, 2 * BS) + [1]) == []
    assert pool.num_cached_blocks == 0
    pool.check_integrity()
    assert pool.all_free()
