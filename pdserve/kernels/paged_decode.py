"""Paged decode attention for GQA/MHA: split-K over the context, then a reduction.

Each decode sequence has one query token. A program takes one sequence, one KV head, a tile
of that KV head's query heads (``BLOCK_H``, padded to 16 so that ``tl.dot`` applies to any
head ratio) and one split of the context; it streams the split's keys through the block
table ``BLOCK_N`` tokens at a time with an online softmax and leaves a partial output and
its log-sum-exp. ``merge_splits`` then combines the splits of each (sequence, head). With a
single split the partial is the answer and is written straight to the output.

Splitting the context is what keeps a GPU busy when the batch is small and contexts are long
(batch × KV heads alone would leave most SMs idle). Scores are kept in base-2 (``exp2``),
so the partial LSEs are base-2 as well.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.common import cast, dot, dot_block, ieee_dot

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
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
    stride_ps,
    stride_ph,
    stride_pl_s,
    stride_pl_h,
    scale_log2,
    group,
    head_dim,
    block_size,
    tokens_per_split,
    DIRECT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head_blocks = tl.cdiv(group, BLOCK_H)
    kv_head = tl.program_id(1) // head_blocks
    h_in_group = (tl.program_id(1) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    heads = (kv_head * group + h_in_group).to(tl.int64)  # [BLOCK_H]
    head_mask = h_in_group < group
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)
    if start < end:
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < head_dim
        q = tl.load(
            q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
            mask=head_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )  # [BLOCK_H, BLOCK_D]
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        k_base = k_ptr + kv_head * stride_kh
        v_base = v_ptr + kv_head * stride_vh
        for n in range(start, end, BLOCK_N):
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
            s = dot(q, tl.trans(k), IEEE)
            s = tl.where(pos_mask[None, :], s * scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            # p is rounded to the value dtype first, as a bf16 GPU kernel must for its MMA.
            acc = acc * alpha[:, None] + dot(cast(p, v.dtype), v, IEEE)
            m_i = m_new
        out = acc / l_i[:, None]
        out_mask = head_mask[:, None] & dim_mask[None, :]
        if DIRECT:
            dst = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :]
            tl.store(dst, cast(out, out_ptr.dtype.element_ty), mask=out_mask)
        else:
            dst = part_out_ptr + seq * stride_ps + heads[:, None] * stride_ph + split * head_dim + dims[None, :]
            tl.store(dst, out, mask=out_mask)
            tl.store(part_lse_ptr + seq * stride_pl_s + heads * stride_pl_h + split, m_i + tl.log2(l_i), mask=head_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_ps,
    stride_ph,
    stride_pl_s,
    stride_pl_h,
    stride_ot,
    stride_oh,
    v_dim,
    tokens_per_split,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    # Splits that start past the end of this sequence were skipped and wrote nothing.
    num_valid = tl.cdiv(tl.load(seq_lens_ptr + seq), tokens_per_split)
    splits = tl.arange(0, BLOCK_SPLITS)
    valid = splits < num_valid
    lse = tl.load(part_lse_ptr + seq * stride_pl_s + head * stride_pl_h + splits, mask=valid, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, axis=0))
    weight = tl.where(valid, weight, 0.0)
    dims = tl.arange(0, BLOCK_D)
    part = tl.load(
        part_out_ptr + seq * stride_ps + head * stride_ph + splits[:, None] * v_dim + dims[None, :],
        mask=valid[:, None] & (dims[None, :] < v_dim),
        other=0.0,
    )  # [BLOCK_SPLITS, BLOCK_D]
    out = tl.sum(part * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + dims, cast(out, out_ptr.dtype.element_ty), mask=dims < v_dim
    )


def split_plan(num_programs: int, max_seq_len: int, block_n: int, num_splits: int | None) -> tuple[int, int]:
    """(number of splits, tokens per split) for a decode batch; ``num_splits`` None picks one.

    On a GPU it aims at about two programs per SM; in the interpreter, where programs run
    one after another, a single split is fastest.
    """
    max_splits = max(1, triton.cdiv(max_seq_len, block_n))
    if num_splits is None:
        if torch.cuda.is_available():
            sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            num_splits = triton.cdiv(2 * sms, max(1, num_programs))
        else:
            num_splits = 1
    num_splits = max(1, min(num_splits, max_splits, 64))
    tokens_per_split = triton.cdiv(triton.cdiv(max(1, max_seq_len), num_splits), block_n) * block_n
    return triton.cdiv(max(1, max_seq_len), tokens_per_split), tokens_per_split


def merge_splits(part_out, part_lse, seq_lens, out, tokens_per_split: int) -> None:
    """Combine partial outputs [S, H, splits, Dv] (fp32) and base-2 LSEs [S, H, splits] into ``out`` [S, H, Dv]."""
    num_seqs, num_heads, num_splits, v_dim = part_out.shape
    _merge_splits_kernel[(num_seqs, num_heads)](
        part_out,
        part_lse,
        seq_lens,
        out,
        part_out.stride(0),
        part_out.stride(1),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        v_dim,
        tokens_per_split,
        BLOCK_SPLITS=triton.next_power_of_2(num_splits),
        BLOCK_D=triton.next_power_of_2(v_dim),
    )


def paged_decode_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor,
    num_splits: int | None = None,
) -> None:
    """One-token attention of q [S, H, D] over paged K/V; writes ``out`` [S, H, D].

    ``layer_cache`` [num_blocks, 2, Hkv, block_size, D] may be a strided view;
    ``block_tables`` [S, max_blocks] and ``seq_lens`` [S] are the decode rows of the
    metadata; ``max_seq_len`` is their host-side maximum (no device sync is needed).
    """
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return
    if q.stride(-1) != 1:
        q = q.contiguous()
    num_kv_heads = layer_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide among {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    block_h = dot_block(group, cap=64)
    block_n = 64 if torch.cuda.is_available() else 32
    num_programs = num_seqs * num_kv_heads * triton.cdiv(group, block_h)
    num_splits, tokens_per_split = split_plan(num_programs, max_seq_len, block_n, num_splits)
    direct = num_splits == 1
    if direct:
        part_out = part_lse = out  # unused
    else:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    k_cache, v_cache = layer_cache[:, 0], layer_cache[:, 1]
    grid = (num_seqs, num_kv_heads * triton.cdiv(group, block_h), num_splits)
    _decode_split_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
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
        part_out.stride(0),
        part_out.stride(1),
        part_lse.stride(0),
        part_lse.stride(1),
        scale * LOG2E,
        group,
        head_dim,
        layer_cache.shape[3],
        tokens_per_split,
        DIRECT=direct,
        IEEE=ieee_dot(q.dtype),
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=dot_block(head_dim),
    )
    if not direct:
        merge_splits(part_out, part_lse, seq_lens, out, tokens_per_split)
