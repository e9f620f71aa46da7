"""MoE expert MLP: grouped GEMMs over expert-sorted rows, SiLU-and-multiply fused in the first.

Rows arrive sorted by expert (``expert_offsets``, no padding). Each program owns one
``BLOCK_M`` tile of one expert's rows; it finds which by walking the per-expert tile counts
(``cdiv(count, BLOCK_M)``) inside the kernel, so the grid is a host-side upper bound
(``cdiv(rows, BLOCK_M) + num_experts``) and nothing is read back to the host. Programs past
the last tile return at once.

The first GEMM computes the gate and up tiles of the same columns side by side and writes
``silu(gate) * up`` directly, so the [rows, 2 * I] product never reaches memory. Rounding
follows the reference: gate and up are rounded to the activation dtype (the reference's
matmul output), then ``silu(gate)``, then the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.backend import DispatchedTokens
from pdserve.kernels.common import cast, dot, ieee_dot


@triton.jit
def _find_tile(offsets_ptr, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, end row) of this program's tile; expert == num_experts if none."""
    pid = tl.program_id(0)
    e_idx = tl.arange(0, BLOCK_E)
    starts = tl.load(offsets_ptr + e_idx, mask=e_idx < num_experts, other=0)
    ends = tl.load(offsets_ptr + e_idx + 1, mask=e_idx < num_experts, other=0)
    tiles = tl.cdiv(ends - starts, BLOCK_M)
    tiles_through = tl.cumsum(tiles, axis=0)  # inclusive
    expert = tl.sum((tiles_through <= pid).to(tl.int32), axis=0)
    first_tile = tl.sum(tl.where(e_idx == expert, tiles_through - tiles, 0), axis=0)
    start = tl.sum(tl.where(e_idx == expert, starts, 0), axis=0)
    end = tl.sum(tl.where(e_idx == expert, ends, 0), axis=0)
    return expert, start + (pid - first_tile) * BLOCK_M, end


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    offsets_ptr,
    out_ptr,
    stride_x,
    stride_we,
    stride_wn,
    stride_o,
    num_experts,
    hidden,
    inter,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    expert, row0, row_end = _find_tile(offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    if expert < num_experts:
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < row_end
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < inter
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < hidden
            x = tl.load(
                x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
            )
            w_mask = k_mask[:, None] & col_mask[None, :]
            w_gate = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)  # [K, N]
            w_up = tl.load(w_base + (inter + cols[None, :]) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            acc_gate += dot(x, w_gate, IEEE)
            acc_up += dot(x, w_up, IEEE)
        dtype = out_ptr.dtype.element_ty
        gate = cast(acc_gate, dtype).to(tl.float32)
        up = cast(acc_up, dtype).to(tl.float32)
        act = cast(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
        tl.store(
            out_ptr + rows[:, None] * stride_o + cols[None, :],
            cast(act * up, dtype),
            mask=row_mask[:, None] & col_mask[None, :],
        )


@triton.jit
def _down_kernel(
    x_ptr,
    w_ptr,
    offsets_ptr,
    out_ptr,
    stride_x,
    stride_we,
    stride_wn,
    stride_o,
    num_experts,
    inter,
    hidden,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    expert, row0, row_end = _find_tile(offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    if expert < num_experts:
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < row_end
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < hidden
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < inter
            x = tl.load(
                x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
            )
            w = tl.load(
                w_base + cols[None, :] * stride_wn + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0
            )
            acc += dot(x, w, IEEE)
        tl.store(
            out_ptr + rows[:, None] * stride_o + cols[None, :],
            cast(acc, out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & col_mask[None, :],
        )


def _tiles(rows: int) -> tuple[int, int, int]:
    if torch.cuda.is_available():
        return 64, 128, 64
    # In the interpreter a tile costs its full size whatever the mask, so keep M small.
    return 16, 64, 64


def expert_mlp(
    tokens: DispatchedTokens, w13: torch.Tensor, w2: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-expert SwiGLU of the dispatched rows: ``(silu(x W1ᵀ) * x W3ᵀ) W2ᵀ``; returns [rows, hidden].

    ``w13`` [E, 2 * I, hidden] stacks W1 (gate) over W3 (up); ``w2`` [E, hidden, I]. Both
    must have a contiguous last dim (any other strides are fine). ``out`` [rows, hidden] may be given.
    """
    x = tokens.hidden if tokens.hidden.stride(-1) == 1 else tokens.hidden.contiguous()
    num_rows, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    if out is None:
        out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("expert weights need a contiguous last dim")
    block_m, block_n, block_k = _tiles(num_rows)
    block_e = triton.next_power_of_2(num_experts)
    max_tiles = triton.cdiv(num_rows, block_m) + num_experts
    act = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    ieee = ieee_dot(x.dtype)
    _gate_up_kernel[(max_tiles, triton.cdiv(inter, block_n))](
        x,
        w13,
        tokens.expert_offsets,
        act,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        num_experts,
        hidden,
        inter,
        IEEE=ieee,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_E=block_e,
    )
    _down_kernel[(max_tiles, triton.cdiv(hidden, block_n))](
        act,
        w2,
        tokens.expert_offsets,
        out,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        num_experts,
        inter,
        hidden,
        IEEE=ieee,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_E=block_e,
    )
    return out
