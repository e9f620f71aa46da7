"""MoE dispatch: sort (token, expert) pairs by expert, stably, and gather their rows.

A counting sort in two passes, one program per expert: count the expert's pairs, then —
knowing every expert's count, hence its offset — give each of its pairs its rank among them
(a cumulative sum, so the order of tokens is kept, as ``torch.argsort(stable=True)`` keeps it)
and write the pair's source token, weight and destination row. A third kernel copies the
hidden rows. Nothing is read back to the host, so the whole dispatch can be graph-captured.

Besides the ``DispatchedTokens`` fields, ``dispatch`` records the row each pair landed on
(``TritonDispatchedTokens.pair_rows``) so that ``moe_combine`` can sum each token's rows in a
fixed order instead of with atomics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.backend import DispatchedTokens
from pdserve.kernels.triton_mode import interpreted

interpreted()  # before any @triton.jit below: raises where they would be compiled for a missing GPU


@dataclass
class TritonDispatchedTokens(DispatchedTokens):
    """``DispatchedTokens`` plus, for pair ``t * top_k + k``, the row it was dispatched to."""

    pair_rows: torch.Tensor | None = None  # [num_tokens * top_k] int64
    top_k: int = 0


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, BLOCK: tl.constexpr):
    expert = tl.program_id(0)
    count = 0
    for start in range(0, num_pairs, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + idx, mask=idx < num_pairs, other=-1)
        count += tl.sum((ids == expert).to(tl.int32), axis=0)
    tl.store(counts_ptr + expert, count)


@triton.jit
def _scatter_kernel(
    ids_ptr,
    weights_ptr,
    counts_ptr,
    offsets_ptr,
    token_index_ptr,
    sorted_weights_ptr,
    pair_rows_ptr,
    num_pairs,
    num_experts,
    top_k,
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    expert = tl.program_id(0)
    e_idx = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + e_idx, mask=e_idx < num_experts, other=0)
    offset = tl.sum(tl.where(e_idx < expert, counts, 0), axis=0).to(tl.int64)
    tl.store(offsets_ptr + expert, offset)
    if expert == num_experts - 1:
        tl.store(offsets_ptr + num_experts, offset + tl.sum(tl.where(e_idx == expert, counts, 0), axis=0))
    ranked = offset
    for start in range(0, num_pairs, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + idx, mask=idx < num_pairs, other=-1)
        mine = ids == expert
        row = ranked + tl.cumsum(mine.to(tl.int64), axis=0) - 1
        tl.store(token_index_ptr + row, (idx // top_k).to(tl.int64), mask=mine)
        tl.store(sorted_weights_ptr + row, tl.load(weights_ptr + idx, mask=mine, other=0.0), mask=mine)
        tl.store(pair_rows_ptr + idx, row, mask=mine)
        ranked += tl.sum(mine.to(tl.int64), axis=0)


@triton.jit
def _gather_rows_kernel(
    src_ptr,
    index_ptr,
    dst_ptr,
    stride_src,
    stride_dst,
    num_rows,
    width,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row_mask = rows < num_rows
    src_rows = tl.load(index_ptr + rows, mask=row_mask, other=0)
    mask = row_mask[:, None] & (cols[None, :] < width)
    vals = tl.load(src_ptr + src_rows[:, None] * stride_src + cols[None, :], mask=mask)
    tl.store(dst_ptr + rows[:, None] * stride_dst + cols[None, :], vals, mask=mask)


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``src[index]`` for a 2-D ``src``; written into ``out`` (new if None)."""
    src = src if src.stride(-1) == 1 else src.contiguous()
    if out is None:
        out = torch.empty(index.shape[0], src.shape[1], dtype=src.dtype, device=src.device)
    if index.shape[0]:
        block = min(1024, triton.next_power_of_2(src.shape[1]))
        rows = max(1, 4096 // block)  # several narrow rows a program, one wide one
        grid = (triton.cdiv(index.shape[0], rows), triton.cdiv(src.shape[1], block))
        _gather_rows_kernel[grid](
            src, index, out, src.stride(0), out.stride(0), index.shape[0], src.shape[1], ROWS=rows, BLOCK=block
        )
    return out


def dispatch(
    hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, num_experts: int
) -> TritonDispatchedTokens:
    """Group (token, expert) pairs of ``expert_ids`` [T, top_k] by expert, stably."""
    num_tokens, top_k = expert_ids.shape
    num_pairs = num_tokens * top_k
    device = hidden.device
    ids = expert_ids.reshape(-1).contiguous()
    counts = torch.empty(num_experts, dtype=torch.int64, device=device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=device)
    token_index = torch.empty(num_pairs, dtype=torch.int64, device=device)
    sorted_weights = torch.empty(num_pairs, dtype=torch.float32, device=device)
    pair_rows = torch.empty(num_pairs, dtype=torch.int64, device=device)
    block = min(1024, triton.next_power_of_2(max(1, num_pairs)))
    _count_kernel[(num_experts,)](ids, counts, num_pairs, BLOCK=block)
    _scatter_kernel[(num_experts,)](
        ids,
        weights.reshape(-1).contiguous().float(),
        counts,
        offsets,
        token_index,
        sorted_weights,
        pair_rows,
        num_pairs,
        num_experts,
        top_k,
        BLOCK=block,
        BLOCK_E=triton.next_power_of_2(num_experts),
    )
    return TritonDispatchedTokens(
        hidden=gather_rows(hidden, token_index),
        expert_offsets=offsets,
        token_index=token_index,
        weights=sorted_weights,
        pair_rows=pair_rows,
        top_k=top_k,
    )
