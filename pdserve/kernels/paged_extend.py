"""Paged prefill/extend attention for GQA/MHA: new tokens against cached prefix + themselves.

Covers prompts, chunked-prefill chunks and prefix-cache hits alike: sequence ``i`` has
``query_len`` new tokens at the end of a context of ``seq_len`` tokens whose K/V (the new
tokens' included) are already in the paged cache. Query ``j`` of the sequence sees keys
``0 .. seq_len - query_len + j``.

A program takes ``BLOCK_M`` queries of one sequence and one head, and streams that
sequence's keys through its block table ``BLOCK_N`` at a time with an online softmax, up to
the causal limit of its last query. The grid is sized from host-side lengths, so no device
sync is needed; programs past the end of a shorter sequence return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.common import cast, dot, dot_block, ieee_dot

LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    seq_lens_ptr,
    starts_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_bt,
    stride_ot,
    stride_oh,
    first_seq,
    scale_log2,
    group,
    head_dim,
    block_size,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = (first_seq + tl.program_id(0)).to(tl.int64)
    q_start = tl.load(starts_ptr + seq)
    query_len = tl.load(starts_ptr + seq + 1) - q_start
    m0 = tl.program_id(1) * BLOCK_M
    if m0 < query_len:
        head = tl.program_id(2).to(tl.int64)
        kv_head = head // group
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix = seq_len - query_len
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < query_len
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < head_dim
        tokens = (q_start + rows).to(tl.int64)
        q = tl.load(
            q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
            mask=row_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        # Causal limit of each row; padded rows reuse the last real row's, so every row
        # sees key 0 and no row's running max stays -inf (which would make NaNs).
        limit = prefix + tl.minimum(rows, query_len - 1)  # [BLOCK_M]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = k_ptr + kv_head * stride_kh
        v_base = v_ptr + kv_head * stride_vh
        end = tl.minimum(seq_len, prefix + m0 + BLOCK_M)
        for n in range(0, end, BLOCK_N):
            pos = n + tl.arange(0, BLOCK_N)
            pos_mask = pos < end
            page = tl.load(tables_ptr + seq * stride_bt + pos // block_size, mask=pos_mask, other=0).to(tl.int64)
            slot = (pos % block_size).to(tl.int64)
            kv_mask = pos_mask[:, None] & dim_mask[None, :]
            k = tl.load(
                k_base + page[:, None] * stride_kb + slot[:, None] * stride_ks + dims[None, :], mask=kv_mask, other=0.0
            )
            v = tl.load(
                v_base + page[:, None] * stride_vb + slot[:, None] * stride_vs + dims[None, :], mask=kv_mask, other=0.0
            )
            s = dot(q, tl.trans(k), IEEE) * scale_log2  # [BLOCK_M, BLOCK_N]
            s = tl.where(pos[None, :] <= limit[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + dot(cast(p, v.dtype), v, IEEE)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
            cast(out, out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & dim_mask[None, :],
        )


def paged_extend_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    first_seq: int,
    num_seqs: int,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Causal attention for sequences ``first_seq .. first_seq + num_seqs - 1``.

    ``q`` [T, H, D] and ``out`` [T, H, D] hold the whole step's tokens (rows are found
    through ``query_start_loc``); ``layer_cache`` [num_blocks, 2, Hkv, block_size, D] may be
    a strided view; ``max_query_len`` is the host-side maximum over these sequences.
    """
    if num_seqs == 0 or max_query_len == 0:
        return
    if q.stride(-1) != 1:
        q = q.contiguous()
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = layer_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide among {num_kv_heads} KV heads")
    block_m = 64 if torch.cuda.is_available() else 32
    block_m = min(block_m, dot_block(max_query_len))
    k_cache, v_cache = layer_cache[:, 0], layer_cache[:, 1]
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        first_seq,
        scale * LOG2E,
        num_heads // num_kv_heads,
        head_dim,
        layer_cache.shape[3],
        IEEE=ieee_dot(q.dtype),
        BLOCK_M=block_m,
        BLOCK_N=32,
        BLOCK_D=dot_block(head_dim),
    )
