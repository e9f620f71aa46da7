"""Which prompt prefixes each prefill worker probably has cached, as the router last left them.

The frontend cannot see a worker's prefix cache; it remembers what it sent where. Each worker
gets an LRU set of chained block hashes (a block's hash covers every token before it, like the
engine's own), bounded by that worker's KV capacity, so a prompt's overlap with a worker is the
number of its leading full blocks found there. An estimate: evictions on the worker are not
seen, and a worker's cache is forgotten when it leaves. A salted prompt's chain starts from its
salt's root, as in the engine (``types.cache_salt``): a prompt never matches blocks another salt
cached, so where a request is routed says nothing of other tenants' prompts.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from pdserve.types.cache_salt import salt_root


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """Chained hashes of the prompt's full blocks, under its ``cache_salt``."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    hashes: list[bytes] = []
    parent = salt_root(cache_salt) or b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.blake2b(parent + tokens[start : start + block_size].tobytes(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Per-worker LRU sets of block hashes."""

    def __init__(self) -> None:
        self._workers: dict[str, OrderedDict[bytes, None]] = {}

    def overlap(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` the worker has (as far as we know)."""
        cached = self._workers.get(worker_id)
        if not cached:
            return 0
        count = 0
        for block_hash in hashes:
            if block_hash not in cached:
                break
            count += 1
        return count

    def record(self, worker_id: str, hashes: Sequence[bytes], capacity_blocks: int) -> None:
        """The worker is about to compute (and cache) these blocks."""
        cached = self._workers.setdefault(worker_id, OrderedDict())
        for block_hash in hashes:
            cached[block_hash] = None
            cached.move_to_end(block_hash)
        while len(cached) > capacity_blocks:
            cached.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
