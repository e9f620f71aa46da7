"""The paged KV cache: one tensor holding every block of every layer.

The whole pool is a single allocation so that it can be registered once with a transfer
engine (NIXL) and so that one block — all layers of it — is one contiguous byte range:
moving a request's KV is then one descriptor per block, whatever the number of layers.

Layouts (``KVCacheSpec.shape``):

- GQA/MHA: ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`` — K at index 0
  and V at index 1; heads before tokens ("HND") so that one head's slice of a block is
  contiguous, which is what a tensor-parallel peer with fewer heads reads.
- MLA:     ``[num_blocks, num_layers, block_size, kv_lora_rank + qk_rope_head_dim]`` — only
  the compressed latent (already normalised) followed by the rotated rope key.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

# kv_cache_dtype "fp8_e4m3": values are stored divided by their layer's scale (model/nn/kv_quant.py).
KV_FP8_DTYPE = torch.float8_e4m3fn
# The kernel's transparent huge page mode: always, madvise or never (the one in brackets).
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token of KV looks like, for one model replica (one TP rank)."""

    num_layers: int
    block_size: int
    dtype: torch.dtype
    is_mla: bool
    num_kv_heads: int = 0  # GQA only
    head_dim: int = 0  # GQA only
    latent_dim: int = 0  # MLA only: kv_lora_rank + qk_rope_head_dim

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.is_mla and self.latent_dim < 1:
            raise ValueError("an MLA KV cache needs latent_dim >= 1")
        if not self.is_mla and (self.num_kv_heads < 1 or self.head_dim < 1):
            raise ValueError("a GQA KV cache needs num_kv_heads >= 1 and head_dim >= 1")

    @property
    def values_per_token_per_layer(self) -> int:
        if self.is_mla:
            return self.latent_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        """Bytes of KV one token occupies across all layers."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return self.values_per_token_per_layer * self.num_layers * element_size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.is_mla:
            return (num_blocks, self.num_layers, self.block_size, self.latent_dim)
        return (num_blocks, self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    def num_blocks_for(self, memory_bytes: int) -> int:
        """How many blocks fit in ``memory_bytes``."""
        return memory_bytes // self.bytes_per_block


class KVCache:
    """Owns the cache tensor and hands each attention layer its view of it."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget holds no block of {spec.bytes_per_block} bytes; raise kv_cache_memory"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        # Zeroed, not empty: a block that is read before it is written (a bug) then reads
        # as zeros rather than as stale data from another request.
        shape = spec.shape(num_blocks)
        # Why a host cache is not on huge pages, or None (on them, or on a GPU).
        self.small_pages_reason: str | None = None
        if device.type == "cpu":
            self.data, self.small_pages_reason = _host_zeros(shape, spec.dtype)
        else:
            self.data = torch.zeros(shape, dtype=spec.dtype, device=device)
        # Made once: every layer of every step asks for its view.
        self._layers = tuple(self.data[:, index] for index in range(spec.num_layers))

    def layer(self, index: int) -> torch.Tensor:
        """Layer ``index``'s view: ``[num_blocks, 2, H, block_size, D]`` or ``[num_blocks, block_size, latent]``."""
        return self._layers[index]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def _host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, str | None]:
    """A zeroed host tensor on transparent huge pages where the kernel offers them, and why
    not where it does not (None when it does).

    A block of every layer is one contiguous range of a few hundred KiB, so a 2 MiB page holds
    several blocks whole. Pinning the pages of a request's blocks, which UCX's cross-process
    copy does for every pull, then costs a few pages instead of hundreds, and the pull between
    two processes runs at about twice the bandwidth (bench/RESULTS.md). Without huge pages the
    cache simply uses normal pages.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # Private: a shared anonymous mapping is shmem, whose huge pages are a separate setting.
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    reason = _thp_unavailable()
    if reason is None:
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError) as exc:  # a kernel built without THP, or not Linux
            reason = f"madvise(MADV_HUGEPAGE) failed: {exc}"
    # The tensor holds the mapping, which is unmapped when the last view of it is freed.
    data = torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
    # The pages are zero already; writing them now commits the memory at start-up, as a
    # torch.zeros would, rather than faulting it in (and compacting for huge pages) mid-step.
    return data.zero_(), reason


def _thp_unavailable() -> str | None:
    """Why this host gives no transparent huge pages to a mapping that asks, or None."""
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return f"{THP_SETTING} is absent (a kernel without transparent huge pages)"
    if "[never]" in setting:
        return f"transparent huge pages are off ({THP_SETTING}: {setting.strip()})"
    return None
