"""MLA prefill/extend attention, absorbed form, over the paged latent cache.

The causal structure is ``paged_extend``'s (new tokens against cached prefix + themselves);
the keys are whole latent rows and the values their first ``v_dim`` columns, loaded once as
in ``mla_decode``, with the key dims split into a ``[0, v_dim)`` and a ``[v_dim, L)`` tile.
A program takes ``BLOCK_M`` queries of one sequence and one head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.common import cast, dot, dot_block, ieee_dot
from pdserve.kernels.paged_decode import LOG2E


@triton.jit
def _mla_extend_kernel(
    q_ptr,
    cache_ptr,
    tables_ptr,
    seq_lens_ptr,
    starts_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_ot,
    stride_oh,
    first_seq,
    scale_log2,
    latent_dim,
    v_dim,
    block_size,
    IEEE: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    seq = (first_seq + tl.program_id(0)).to(tl.int64)
    q_start = tl.load(starts_ptr + seq)
    query_len = tl.load(starts_ptr + seq + 1) - q_start
    m0 = tl.program_id(1) * BLOCK_M
    if m0 < query_len:
        head = tl.program_id(2).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix = seq_len - query_len
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < query_len
        tokens = (q_start + rows).to(tl.int64)
        vdims = tl.arange(0, BLOCK_V)
        v_mask = vdims < v_dim
        q_rows = q_ptr + tokens[:, None] * stride_qt + head * stride_qh
        q_lat = tl.load(q_rows + vdims[None, :], mask=row_mask[:, None] & v_mask[None, :], other=0.0)
        if HAS_ROPE:
            rdims = v_dim + tl.arange(0, BLOCK_R)
            r_mask = rdims < latent_dim
            q_rope = tl.load(q_rows + rdims[None, :], mask=row_mask[:, None] & r_mask[None, :], other=0.0)
        # Padded rows take the last real row's causal limit, so no row is all -inf.
        limit = prefix + tl.minimum(rows, query_len - 1)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        end = tl.minimum(seq_len, prefix + m0 + BLOCK_M)
        for n in range(0, end, BLOCK_N):
            pos = n + tl.arange(0, BLOCK_N)
            pos_mask = pos < end
            page = tl.load(tables_ptr + seq * stride_bt + pos // block_size, mask=pos_mask, other=0).to(tl.int64)
            kv_rows = cache_ptr + page[:, None] * stride_cb + (pos % block_size).to(tl.int64)[:, None] * stride_cs
            lat = tl.load(kv_rows + vdims[None, :], mask=pos_mask[:, None] & v_mask[None, :], other=0.0)
            s = dot(q_lat, tl.trans(lat), IEEE)
            if HAS_ROPE:
                rope = tl.load(kv_rows + rdims[None, :], mask=pos_mask[:, None] & r_mask[None, :], other=0.0)
                s += dot(q_rope, tl.trans(rope), IEEE)
            s = tl.where(pos[None, :] <= limit[:, None], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + dot(cast(p, lat.dtype), lat, IEEE)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + tokens[:, None] * stride_ot + head * stride_oh + vdims[None, :],
            cast(out, out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & v_mask[None, :],
        )


def mla_extend_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    first_seq: int,
    num_seqs: int,
    max_query_len: int,
    scale: float,
    v_dim: int,
    out: torch.Tensor,
) -> None:
    """Causal absorbed MLA for sequences ``first_seq .. first_seq + num_seqs - 1``.

    ``q`` [T, H, L] and ``out`` [T, H, v_dim] hold the whole step's tokens; ``layer_cache``
    [num_blocks, block_size, L] may be a strided view.
    """
    if num_seqs == 0 or max_query_len == 0:
        return
    num_heads, latent_dim = q.shape[1], q.shape[2]
    if not 0 < v_dim <= latent_dim:
        raise ValueError(f"v_dim {v_dim} must be in 1..{latent_dim}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_m = min(32, dot_block(max_query_len))
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _mla_extend_kernel[grid](
        q,
        layer_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        q.stride(0),
        q.stride(1),
        layer_cache.stride(0),
        layer_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        first_seq,
        scale * LOG2E,
        latent_dim,
        v_dim,
        layer_cache.shape[1],
        IEEE=ieee_dot(q.dtype),
        HAS_ROPE=latent_dim > v_dim,
        BLOCK_M=block_m,
        BLOCK_N=32,
        BLOCK_V=dot_block(v_dim),
        BLOCK_R=dot_block(latent_dim - v_dim),
    )
