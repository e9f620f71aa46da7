"""The block pool: which KV blocks are free, which are in use, which hold a cached prefix.

Pure bookkeeping over block ids; it never touches the cache tensor. Invariants:

- every block is either referenced (``ref_count > 0``) or in the free queue, never both;
- a block in the free queue may still hold a cached prefix (``block_hash`` set): it is reused
  on a prefix hit, or evicted — least recently freed first — when a fresh block is needed;
- a hash names at most one block, and a hit is only a hit if the block's tokens match and
  its parent is the block just matched, as it was when this block was cached — for a first
  block, the tenant salt's root it was cached under (a hash is not proof: even a colliding
  hash can never serve another prefix's KV, nor one tenant's KV to another).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Hash of a full block, chained to its parent's so it names the whole prefix.

    Stable across processes (unlike ``hash()``), so routers can compare prefixes that
    different workers cached.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash or b"")
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    # The tokens the block holds and its parent (block id, generation) — a first block's is its
    # salt root (``types.cache_salt``), None unsalted —, kept while it is cached so a hit can be verified.
    token_ids: tuple[int, ...] | None = None
    parent: tuple[int, int] | bytes | None = None
    # Bumped whenever the block stops holding a cached prefix, so children cached under an
    # earlier content of this block no longer match it.
    generation: int = 0


class BlockPool:
    """Fixed set of KV blocks with reference counts and an LRU prefix cache."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Front = evicted first. Holds every block with ref_count == 0.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or cached-but-unreferenced)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` fresh blocks (ref_count 1), evicting cached ones LRU-first."""
        if num_blocks > len(self._free):
            raise RuntimeError(
                f"asked for {num_blocks} blocks with {len(self._free)} free; callers must check num_free_blocks first"
            )
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def lookup(
        self, block_hash: bytes, token_ids: Sequence[int], parent_id: int | None, salt_root: bytes | None = None
    ) -> int | None:
        """The cached block holding exactly ``token_ids`` after block ``parent_id``, if any;
        a first block (``parent_id`` None) only if it was cached under the same ``salt_root``."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != tuple(token_ids) or block.parent != self._parent_key(parent_id, salt_root):
            return None  # a hash collision: never serve another prefix's (or tenant's) KV
        return block_id

    def _parent_key(self, parent_id: int | None, salt_root: bytes | None) -> tuple[int, int] | bytes | None:
        return salt_root if parent_id is None else (parent_id, self.blocks[parent_id].generation)

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Add a reference to blocks found by ``lookup`` (taking them off the free queue)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop a reference; blocks reaching zero join the back of the free queue in order."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} released more often than acquired")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def cache(
        self,
        block_id: int,
        block_hash: bytes,
        token_ids: Sequence[int],
        parent_id: int | None,
        salt_root: bytes | None = None,
    ) -> None:
        """Record that a full block holds ``token_ids`` after block ``parent_id`` (the prefix
        named by ``block_hash``); a first block records the ``salt_root`` it was computed under."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return  # already cached, or another block holds the same prefix: keep that one
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.parent = self._parent_key(parent_id, salt_root)
        self._cached[block_hash] = block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents)."""
        for block in self.blocks:
            self._uncache(block)
        self._cached.clear()

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            self._uncache(block)

    @staticmethod
    def _uncache(block: Block) -> None:
        if block.block_hash is not None:
            block.generation += 1
        block.block_hash = None
        block.token_ids = None
        block.parent = None

    def check_integrity(self) -> None:
        """Assert the pool's invariants; cheap enough for tests and idle moments."""
        free = set(self._free)
        for block in self.blocks:
            in_free = block.block_id in free
            assert block.ref_count >= 0, f"block {block.block_id} has ref_count {block.ref_count}"
            assert in_free == (block.ref_count == 0), (
                f"block {block.block_id}: ref_count {block.ref_count} but in_free={in_free}"
            )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id
        assert len(self._cached) == sum(b.block_hash is not None for b in self.blocks)

    def all_free(self) -> bool:
        """True when no block is referenced: what every finished scenario must end with."""
        return len(self._free) == self.num_blocks
