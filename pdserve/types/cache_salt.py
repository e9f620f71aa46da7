"""The prefix cache's tenant salt: what a ``cache_salt`` mixes into a prompt's first block.

A salted prompt's chain of block hashes starts from ``salt_root(salt)`` instead of nothing, so
every block of it hashes apart from the same tokens under another salt (or none): the engine's
prefix cache (``engine.kv_cache_manager``) and the frontend's prefix index (``frontend.prefix_index``)
then share blocks only between requests of the same salt. vLLM does the same with its
``cache_salt``, in the first block's extra keys. No salt gives no root: unsalted hashes are
those pdserve always had. Standard library only.
"""

from __future__ import annotations

import hashlib

_DOMAIN = b"pdserve-cache-salt\x00"


def salt_root(cache_salt: str | None) -> bytes | None:
    """The parent hash of a salted prompt's first block; None without a salt (or an empty one)."""
    if not cache_salt:
        return None
    return hashlib.blake2b(_DOMAIN + cache_salt.encode(errors="surrogatepass"), digest_size=16).digest()
