"""Block-scaled FP8 GEMM (DeepSeek-V3's linears): ``y = x · Wᵀ`` with W block-FP8.

Two kernels, the arithmetic of ``block_fp8.block_fp8_linear`` (the torch reference):

- ``_quantize_kernel``: one program per (token, group of ``bi`` columns) computes the group's
  ``amax / 448`` scale and writes the group rounded to FP8.
- ``_gemm_kernel``: one program per ``BLOCK_M x BLOCK_N`` output tile walks the column groups;
  each group's FP8 product is accumulated in float32 (``tl.dot``), then multiplied by the
  token's group scale and each output column's block scale and added to the tile, so the FP8
  accumulation never runs longer than one group (DeepSeek's promotion interval).

Any block size works: a group is loaded as a power-of-two tile (at least 16 wide) masked to
``bi`` columns, and the weight scale of an output column is ``scale_inv[n // bo, g]``.

In Triton's interpreter (Triton 3.9) the conversion float32 → float8e4nv rounds wrongly when a
value rounds up into the next binade (126.5 gives 64), so there ``_to_fp8`` rounds on the
bits first (round to nearest even, as a GPU and torch do); the conversion of the rounded,
exactly representable value is then exact. On a GPU it is the native conversion.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.block_fp8 import FP8_DTYPE, FP8_MAX, BlockFP8Weight
from pdserve.kernels.common import INTERPRETED, cast, dot, dot_block

_INTERPRETED = tl.constexpr(INTERPRETED)


@triton.jit
def _to_fp8(x):
    """float32 (within ±448) → float8e4nv, rounding to nearest even."""
    if _INTERPRETED:
        magnitude = tl.abs(x)
        bits = magnitude.to(tl.uint32, bitcast=True)
        # Normal FP8 values keep 3 mantissa bits; a carry moves into the exponent, as it must.
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        # Below 2^-6 FP8 is subnormal: a fixed step of 2^-9, which adding 2^14 rounds to.
        subnormal = (magnitude + 16384.0) - 16384.0
        rounded = tl.where(magnitude < 0.015625, subnormal, normal)
        sign = x.to(tl.uint32, bitcast=True) & 0x80000000
        x = (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return x.to(tl.float8e4nv)


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, stride_q, stride_s, num_cols, group, fp8_max, BLOCK_K: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK_K)
    cols = g * group + offs
    mask = (offs < group) & (cols < num_cols)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.where(amax > 0, amax / fp8_max, 1.0)
    q = tl.minimum(tl.maximum(x / scale, -fp8_max), fp8_max)
    tl.store(q_ptr + row * stride_q + cols, _to_fp8(q), mask=mask)
    tl.store(scale_ptr + row * stride_s + g, scale)


@triton.jit
def _gemm_kernel(
    xq_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    num_out,
    num_in,
    num_groups,
    block_out,
    group,
    stride_xq,
    stride_xs,
    stride_w,
    stride_ws,
    stride_o,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    col_mask = cols < num_out
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    scale_rows = cols // block_out  # each output column's row of weight scales
    offs = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(0, num_groups):
        ks = g * group + offs
        k_mask = (offs < group) & (ks < num_in)
        a = tl.load(
            xq_ptr + rows64[:, None] * stride_xq + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
        b = tl.load(
            w_ptr + cols64[None, :] * stride_w + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0
        )
        # [M, N]: this group's FP8 products, summed in float32 (exact products; in the
        # interpreter through float32 operands, which hold every FP8 value exactly).
        partial = dot(a, b, IEEE)
        a_scale = tl.load(xs_ptr + rows64 * stride_xs + g, mask=row_mask, other=0.0)
        w_scale = tl.load(ws_ptr + scale_rows * stride_ws + g, mask=col_mask, other=0.0)
        acc += partial * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows64[:, None] * stride_o + cols64[None, :]
    tl.store(out, cast(acc, out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and per ``group`` columns: (xq [M, K] fp8, scale [M, ceil(K / group)] float32)."""
    num_rows, num_cols = x.shape
    num_groups = triton.cdiv(num_cols, group)
    xq = torch.empty(num_rows, num_cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_rows, num_groups, dtype=torch.float32, device=x.device)
    if num_rows:
        _quantize_kernel[(num_rows, num_groups)](
            x,
            xq,
            scale,
            x.stride(0),
            xq.stride(0),
            scale.stride(0),
            num_cols,
            group,
            FP8_MAX,
            BLOCK_K=triton.next_power_of_2(group),
        )
    return xq, scale


def block_fp8_linear(x: torch.Tensor, weight: BlockFP8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., in] · Wᵀ (+ bias)`` → [..., out] in x's dtype, W block-FP8; x quantized per
    token and group of ``bi`` columns on the way in."""
    block_out, group = weight.block_size
    num_out, num_in = weight.shape
    rows = x.reshape(-1, num_in)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    xq, x_scale = quantize_activations(rows, group)
    out = torch.empty(rows.shape[0], num_out, dtype=x.dtype, device=x.device)
    block_m = dot_block(rows.shape[0], 64)
    block_n = 64 if num_out >= 64 else dot_block(num_out)
    grid = (triton.cdiv(rows.shape[0], block_m), triton.cdiv(num_out, block_n))
    if rows.shape[0]:
        _gemm_kernel[grid](
            xq,
            x_scale,
            weight.weight,
            weight.scale_inv,
            bias if bias is not None else out,
            out,
            rows.shape[0],
            num_out,
            num_in,
            x_scale.shape[1],
            block_out,
            group,
            xq.stride(0),
            x_scale.stride(0),
            weight.weight.stride(0),
            weight.scale_inv.stride(0),
            out.stride(0),
            HAS_BIAS=bias is not None,
            IEEE=INTERPRETED,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=max(32, dot_block(group)),  # FP8 MMA: K >= 32
        )
    return out.reshape(*x.shape[:-1], num_out)
