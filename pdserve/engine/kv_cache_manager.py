"""Per-request block tables on top of the block pool: the narrow API the scheduler uses.

``find_cached_prefix`` → ``allocate`` (as tokens are scheduled) → ``cache_full_blocks``
(after they are computed) → ``free``. Everything here is bookkeeping over block ids.

A request's ``cache_salt`` starts its chain of block hashes (``types.cache_salt``): blocks are
shared only between requests of the same salt, so one tenant cannot time another's prefixes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve.engine.block_pool import BlockPool, hash_block
from pdserve.types.cache_salt import salt_root

BlockHasher = Callable[[bytes | None, Sequence[int]], bytes]


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, hasher: BlockHasher = hash_block) -> None:
        self.pool = pool
        self.block_size = block_size
        self.hasher = hasher
        self._blocks: dict[str, list[int]] = {}
        # Chained hashes of the request's full blocks, as far as they have been computed.
        self._hashes: dict[str, list[bytes]] = {}

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def find_cached_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """Cached blocks covering the longest prefix of ``token_ids`` (full blocks only), among
        those cached under the same ``cache_salt``.

        The last token is never served from cache: the model must run on at least one
        token to produce the next token's logits.
        """
        if not self.pool.enable_prefix_caching:
            return []
        block_ids: list[int] = []
        root = parent = salt_root(cache_salt)
        bs = self.block_size
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            chunk = token_ids[start : start + bs]
            parent = self.hasher(parent, chunk)
            block_id = self.pool.lookup(parent, chunk, block_ids[-1] if block_ids else None, root)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def can_allocate(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Whether the request can hold ``num_tokens`` tokens, taking ``cached`` blocks first."""
        held = len(self._blocks.get(request_id, ())) + len(cached)
        needed = self.num_blocks_for(num_tokens) - held
        # Cached blocks with no other user sit in the free queue: taking them uses it up too.
        reclaimed = sum(1 for b in cached if self.pool.blocks[b].ref_count == 0)
        return needed + reclaimed <= self.pool.num_free_blocks

    def allocate(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Grow the request's table to cover ``num_tokens`` tokens; False (and no change) if full."""
        if not self.can_allocate(request_id, num_tokens, cached):
            return False
        blocks = self._blocks.setdefault(request_id, [])
        if cached:
            assert not blocks, "cached prefix blocks must be taken before any other block"
            self.pool.acquire(cached)
            blocks.extend(cached)
        missing = self.num_blocks_for(num_tokens) - len(blocks)
        if missing > 0:
            blocks.extend(self.pool.allocate(missing))
        return True

    def cache_full_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed: int, cache_salt: str | None = None
    ) -> None:
        """Register the request's blocks that are now full and computed in the prefix cache,
        under its ``cache_salt`` (the same on every call for a request)."""
        if not self.pool.enable_prefix_caching:
            return
        hashes = self._hashes.setdefault(request_id, [])
        blocks = self._blocks[request_id]
        bs = self.block_size
        root = salt_root(cache_salt)
        for index in range(len(hashes), num_computed // bs):
            chunk = token_ids[index * bs : (index + 1) * bs]
            parent = hashes[-1] if hashes else root
            block_hash = self.hasher(parent, chunk)
            hashes.append(block_hash)
            self.pool.cache(blocks[index], block_hash, chunk, blocks[index - 1] if index else None, root)

    def free(self, request_id: str) -> None:
        """Release every block of the request; tail blocks become the first to be evicted."""
        blocks = self._blocks.pop(request_id, [])
        self._hashes.pop(request_id, None)
        self.pool.release(reversed(blocks))

    def holds(self, request_id: str) -> bool:
        return request_id in self._blocks
