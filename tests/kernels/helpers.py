"""Shared pieces of the kernel tests: random paged caches and step metadata.

Every call draws fresh random inputs (no fixed seed), so repeated runs cover new values;
a failure prints the shapes and lengths that produced it.
"""

from __future__ import annotations

import os

import torch

# Without a GPU the kernels run in Triton's interpreter on CPU tensors (triton_backend would
# select it too; the tests import kernel modules directly, so they make the choice first).
# With one, the same tests run compiled on CUDA tensors (see conftest.py) unless
# TRITON_INTERPRET=1 is set explicitly.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"

from pdserve.kernels.backend import AttentionMetadata  # noqa: E402 (after TRITON_INTERPRET is set)

# Tolerances per dtype. Float32: the kernels and the reference differ only in summation
# order. Bfloat16: both compute in float32 from the same bf16 inputs, but the kernels round
# attention probabilities (and MoE intermediates) to bf16 before the second matmul as a GPU
# kernel must, and the output's last bit (2^-8 relative) may differ after rounding.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = [torch.float32, torch.bfloat16]


def poisoned(shape, dtype) -> torch.Tensor:
    """A tensor every element of which is NaN, so an unwritten element fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype)


def make_metadata(seq_lens: list[int], query_lens: list[int], block_size: int, num_blocks: int) -> AttentionMetadata:
    """Metadata for sequences with the given context and query lengths, on shuffled blocks.

    Blocks are drawn without replacement from a random permutation of the pool, so a
    sequence's blocks are neither contiguous nor in order; table padding is 0, as in the engine.
    """
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    if sum(blocks_per_seq) > num_blocks:
        raise ValueError("not enough blocks for these sequences")
    perm = torch.randperm(num_blocks).tolist()
    max_blocks = max(blocks_per_seq, default=1) or 1
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots = []
    for i, (seq_len, qlen) in enumerate(zip(seq_lens, query_lens)):
        mine = [perm.pop() for _ in range(blocks_per_seq[i])]
        tables[i, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
        for pos in range(seq_len - qlen, seq_len):
            slots.append(mine[pos // block_size] * block_size + pos % block_size)
    starts = [0]
    for qlen in query_lens:
        starts.append(starts[-1] + qlen)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens_list=list(seq_lens),
        query_lens_list=list(query_lens),
        num_decodes=num_decodes,
        block_size=block_size,
    )


def layer_view(full: torch.Tensor, layer: int = 1) -> torch.Tensor:
    """Layer ``layer`` of a whole-pool cache [num_blocks, num_layers, ...]: a strided view, as the engine's."""
    return full[:, layer]


def gqa_cache(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype) -> torch.Tensor:
    """A random 2-layer GQA pool's layer-1 view [num_blocks, 2, Hkv, block_size, D]."""
    return layer_view(torch.randn(num_blocks, 2, 2, num_kv_heads, block_size, head_dim).to(dtype))


def mla_cache(num_blocks: int, block_size: int, latent_dim: int, dtype) -> torch.Tensor:
    """A random 2-layer MLA pool's layer-1 view [num_blocks, block_size, L]."""
    return layer_view(torch.randn(num_blocks, 2, block_size, latent_dim).to(dtype))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, context: str = "") -> None:
    """Compare with the per-dtype tolerance; NaN anywhere (an unwritten element) fails."""
    assert not torch.isnan(actual).any(), f"unwritten (NaN) elements {context}"
    torch.testing.assert_close(
        actual.float(), expected.float(), **TOLERANCES[expected.dtype], msg=lambda m: f"{context}\n{m}"
    )
