"""MoE combine: each token's expert outputs, weighted and summed, in float32.

With the pair-to-row map that ``moe_align.dispatch`` records, one program per (token, column
tile) sums its ``top_k`` rows in a fixed order: deterministic, and no atomics. For
``DispatchedTokens`` built elsewhere (no map), rows are scattered with float32 atomic adds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.backend import DispatchedTokens
from pdserve.kernels.common import cast
from pdserve.kernels.moe_align import TritonDispatchedTokens


@triton.jit
def _combine_kernel(
    x_ptr,
    weights_ptr,
    pair_rows_ptr,
    out_ptr,
    stride_x,
    stride_o,
    width,
    top_k,
    BLOCK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    acc = tl.zeros([BLOCK], tl.float32)
    for k in range(0, top_k):
        row = tl.load(pair_rows_ptr + tok * top_k + k)
        w = tl.load(weights_ptr + row)
        acc += tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32) * w
    tl.store(out_ptr + tok * stride_o + cols, cast(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scatter_add_kernel(x_ptr, weights_ptr, index_ptr, acc_ptr, stride_x, stride_a, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    vals = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(weights_ptr + row)
    tl.atomic_add(acc_ptr + tl.load(index_ptr + row) * stride_a + cols, vals, mask=mask)


def combine(
    expert_out: torch.Tensor, tokens: DispatchedTokens, num_tokens: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Weighted sum of each token's rows of ``expert_out`` [rows, hidden]; returns ``out`` (new if None) [num_tokens, hidden]."""
    x = expert_out if expert_out.stride(-1) == 1 else expert_out.contiguous()
    width = x.shape[1]
    block = min(1024, triton.next_power_of_2(width))
    pair_rows, top_k = (tokens.pair_rows, tokens.top_k) if isinstance(tokens, TritonDispatchedTokens) else (None, 0)
    if pair_rows is not None and top_k * num_tokens == pair_rows.shape[0]:
        if out is None:
            out = torch.empty(num_tokens, width, dtype=x.dtype, device=x.device)
        if num_tokens:
            _combine_kernel[(num_tokens, triton.cdiv(width, block))](
                x,
                tokens.weights,
                pair_rows,
                out,
                x.stride(0),
                out.stride(0),
                width,
                top_k,
                BLOCK=block,
            )
        return out
    acc = torch.zeros(num_tokens, width, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _scatter_add_kernel[(x.shape[0], triton.cdiv(width, block))](
            x,
            tokens.weights,
            tokens.token_index,
            acc,
            x.stride(0),
            acc.stride(0),
            width,
            BLOCK=block,
        )
    if out is None:
        return acc.to(x.dtype)
    out.copy_(acc)
    return out
