"""MLA decode attention, absorbed form, over the paged latent cache; split-K like GQA decode.

With the up-projections absorbed into the query and the output, every head attends to the
same cached rows: keys are the full latent row (``kv_lora_rank`` compressed dims, then the
rotated rope dims — 512 + 64 = 576 for DeepSeek-V3) and values are its first ``v_dim``
columns. So a program loads each latent tile once and uses it as both key and value, for a
tile of ``BLOCK_H`` heads at a time: that reuse is what makes MLA decode memory-light.

The key dims are handled as two tiles, ``[0, v_dim)`` and ``[v_dim, L)``, so a 576-wide row
costs a 512 and a 64 tile rather than a padded 1024 one. Splits are merged by
``paged_decode.merge_splits``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.common import cast, dot, dot_block, ieee_dot
from pdserve.kernels.paged_decode import LOG2E, merge_splits, split_plan


@triton.jit
def _mla_decode_split_kernel(
    q_ptr,
    cache_ptr,
    tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_ps,
    stride_ph,
    stride_pl_s,
    stride_pl_h,
    scale_log2,
    num_heads,
    latent_dim,
    v_dim,
    block_size,
    tokens_per_split,
    DIRECT: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    heads = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    head_mask = heads < num_heads
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)
    if start < end:
        vdims = tl.arange(0, BLOCK_V)
        v_mask = vdims < v_dim
        q_rows = q_ptr + seq * stride_qt + heads[:, None] * stride_qh
        q_lat = tl.load(q_rows + vdims[None, :], mask=head_mask[:, None] & v_mask[None, :], other=0.0)
        if HAS_ROPE:
            rdims = v_dim + tl.arange(0, BLOCK_R)
            r_mask = rdims < latent_dim
            q_rope = tl.load(q_rows + rdims[None, :], mask=head_mask[:, None] & r_mask[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
        for n in range(start, end, BLOCK_N):
            pos = n + tl.arange(0, BLOCK_N)
            pos_mask = pos < end
            page = tl.load(tables_ptr + seq * stride_bt + pos // block_size, mask=pos_mask, other=0).to(tl.int64)
            rows = cache_ptr + page[:, None] * stride_cb + (pos % block_size).to(tl.int64)[:, None] * stride_cs
            lat = tl.load(rows + vdims[None, :], mask=pos_mask[:, None] & v_mask[None, :], other=0.0)  # [N, V]
            s = dot(q_lat, tl.trans(lat), IEEE)
            if HAS_ROPE:
                rope = tl.load(rows + rdims[None, :], mask=pos_mask[:, None] & r_mask[None, :], other=0.0)
                s += dot(q_rope, tl.trans(rope), IEEE)
            s = tl.where(pos_mask[None, :], s * scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + dot(cast(p, lat.dtype), lat, IEEE)  # the latent is the value too
            m_i = m_new
        out = acc / l_i[:, None]
        out_mask = head_mask[:, None] & v_mask[None, :]
        if DIRECT:
            dst = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + vdims[None, :]
            tl.store(dst, cast(out, out_ptr.dtype.element_ty), mask=out_mask)
        else:
            dst = part_out_ptr + seq * stride_ps + heads[:, None] * stride_ph + split * v_dim + vdims[None, :]
            tl.store(dst, out, mask=out_mask)
            tl.store(part_lse_ptr + seq * stride_pl_s + heads * stride_pl_h + split, m_i + tl.log2(l_i), mask=head_mask)


def mla_decode_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    v_dim: int,
    out: torch.Tensor,
    num_splits: int | None = None,
) -> None:
    """One-token absorbed MLA of q [S, H, L] over latents [num_blocks, block_size, L]; writes ``out`` [S, H, v_dim]."""
    num_seqs, num_heads, latent_dim = q.shape
    if num_seqs == 0:
        return
    if not 0 < v_dim <= latent_dim:
        raise ValueError(f"v_dim {v_dim} must be in 1..{latent_dim}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    # 16 heads a program keeps the fp32 accumulator [16, 512] in registers on a GPU.
    block_h = dot_block(num_heads, cap=16 if torch.cuda.is_available() else 64)
    block_n = 32
    num_programs = num_seqs * triton.cdiv(num_heads, block_h)
    num_splits, tokens_per_split = split_plan(num_programs, max_seq_len, block_n, num_splits)
    direct = num_splits == 1
    if direct:
        part_out = part_lse = out  # unused
    else:
        part_out = torch.empty(num_seqs, num_heads, num_splits, v_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    grid = (num_seqs, triton.cdiv(num_heads, block_h), num_splits)
    _mla_decode_split_kernel[grid](
        q,
        layer_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        layer_cache.stride(0),
        layer_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_lse.stride(0),
        part_lse.stride(1),
        scale * LOG2E,
        num_heads,
        latent_dim,
        v_dim,
        layer_cache.shape[1],
        tokens_per_split,
        DIRECT=direct,
        IEEE=ieee_dot(q.dtype),
        HAS_ROPE=latent_dim > v_dim,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_V=dot_block(v_dim),
        BLOCK_R=dot_block(latent_dim - v_dim),
    )
    if not direct:
        merge_splits(part_out, part_lse, seq_lens, out, tokens_per_split)
