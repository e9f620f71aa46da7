"""Rotary position embedding, GPT-NeoX (halves) or GPT-J/DeepSeek (interleaved pairs) style.

Table-driven: ``cos_sin`` [max_pos, D] holds cos in its first half and sin in its second, so
any frequency scaling (Llama-3 rope scaling, DeepSeek's YaRN with its mscale) lives in the
table the model builds and this kernel is the same for all of them. One program per token
rotates all its heads; ``x`` may be a strided view (e.g. the rope slice of a query).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.common import cast


@triton.jit
def _rotary_kernel(
    x_ptr,
    pos_ptr,
    cs_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_xd,
    stride_cs,
    stride_ot,
    stride_oh,
    num_heads,
    half,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    idx = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (idx < half)
    cos = tl.load(cs_ptr + pos * stride_cs + idx, mask=idx < half, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + half + idx, mask=idx < half, other=0.0).to(tl.float32)
    if INTERLEAVED:
        d1 = 2 * idx
        d2 = 2 * idx + 1
    else:
        d1 = idx
        d2 = idx + half
    x_row = x_ptr + tok * stride_xt + heads * stride_xh
    x1 = tl.load(x_row + d1 * stride_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + d2 * stride_xd, mask=mask, other=0.0).to(tl.float32)
    o_row = out_ptr + tok * stride_ot + heads * stride_oh
    tl.store(o_row + d1, cast(x1 * cos - x2 * sin, out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + d2, cast(x2 * cos + x1 * sin, out_ptr.dtype.element_ty), mask=mask)


def rotary(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, interleaved: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] by ``positions`` [T]; returns ``out`` (new if None) [T, H, D], head_dim contiguous."""
    num_tokens, num_heads, dim = x.shape
    if dim % 2:
        raise ValueError(f"rotary needs an even head dim, got {dim}")
    if out is None:
        out = torch.empty((num_tokens, num_heads, dim), dtype=x.dtype, device=x.device)
    cos_sin = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            x,
            positions,
            cos_sin,
            out,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            cos_sin.stride(0),
            out.stride(0),
            out.stride(1),
            num_heads,
            dim // 2,
            INTERLEAVED=interleaved,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_HALF=triton.next_power_of_2(dim // 2),
        )
    return out
