"""The reference backend: plain torch, on CPU or GPU.

Written for clarity first; the Triton kernels are checked against these functions.
Attention copies the blocks it reads out of the paged cache with ``index_select`` (whole
blocks, each a contiguous run) and computes on them where they land: decodes as one batch
over all their blocks, every other sequence on its own with torch's SDPA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.kernels.backend import AttentionMetadata, Backend, DispatchedTokens

# (layer cache, block ids [B]) → keys [B, Hkv, bs, D], values [B, Hkv, bs, Dv]: copies of those blocks
GatherKV = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# The decodes' queries [S, H, D] → their attention outputs [S, H, Dv]
DecodeAttention = Callable[[torch.Tensor], torch.Tensor]


def attend_cached(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    gather_kv: GatherKV,
    decode: DecodeAttention,
) -> torch.Tensor:
    """Causal attention of every sequence's new tokens over its cached context.

    Decodes run as one batch through ``decode``; longer queries one sequence at a time with
    SDPA, with a bottom-right causal mask when part of the context was cached before this
    step.
    """
    nd = meta.num_decodes
    parts = []
    if nd:
        parts.append(decode(q[:nd]))
    start = nd
    for i in range(nd, meta.num_seqs):
        qlen, seq_len = meta.query_lens_list[i], meta.seq_lens_list[i]
        blocks = gather_kv(layer_cache, meta.block_tables[i, : -(-seq_len // meta.block_size)])
        k, v = (_contiguous(x, seq_len).to(q.dtype) for x in blocks)
        qi = q[start : start + qlen].transpose(0, 1)[None]  # [1, H, qlen, D]
        if qlen == seq_len:
            out = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            key_pos = torch.arange(seq_len, device=q.device)
            query_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]
            out = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        parts.append(out[0].transpose(0, 1))
        start += qlen
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _contiguous(blocks: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's blocks [nb, Hkv, bs, D] as the [1, Hkv, length, D] SDPA reads."""
    num_blocks, num_kv_heads, block_size, dim = blocks.shape
    return blocks.transpose(0, 1).reshape(1, num_kv_heads, num_blocks * block_size, dim)[:, :, :length]


def decode_attention(
    q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float, gather_kv: GatherKV
) -> torch.Tensor:
    """Single-token queries q [S, H, D] of the step's first S sequences; returns [S, H, Dv].

    The blocks of all S sequences are gathered back to back (B blocks, no padding to the
    longest context) and each block meets its own sequence's query in one batched matmul,
    so the blocks are read where they land instead of being copied again into one run per
    sequence and head. The softmax spans a sequence's blocks through a per-sequence max
    and sum.
    """
    num_seqs, num_heads, dim = q.shape
    bs = meta.block_size
    seq_lens = meta.seq_lens[:num_seqs]
    tables = meta.block_tables[:num_seqs]
    in_use = torch.arange(tables.shape[1], device=q.device) < (seq_lens[:, None] + bs - 1) // bs
    seq_index, block_index = in_use.nonzero(as_tuple=True)  # [B] each, in the order of tables[in_use]
    k, v = gather_kv(layer_cache, tables[in_use])  # [B, Hkv, bs, D], [B, Hkv, bs, Dv]
    num_blocks, num_kv_heads, _, v_dim = v.shape
    group = num_heads // num_kv_heads
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()  # no-ops in float32; lower precisions accumulate in float32
    block_q = q[seq_index].view(num_blocks, num_kv_heads, group, dim)
    scores = torch.matmul(block_q, k.transpose(-1, -2)).mul_(scale)  # [B, Hkv, group, bs]
    positions = block_index[:, None] * bs + torch.arange(bs, device=q.device)  # [B, bs]
    scores.masked_fill_((positions >= seq_lens[seq_index, None])[:, None, None, :], float("-inf"))
    seq_max = _per_sequence(scores.amax(dim=-1), seq_index, num_seqs, "amax")  # [S, Hkv, group]
    probs = scores.sub_(seq_max[seq_index, ..., None]).exp_()
    denominator = _per_sequence(probs.sum(dim=-1), seq_index, num_seqs, "sum")  # [S, Hkv, group]
    out = _per_sequence(torch.matmul(probs, v), seq_index, num_seqs, "sum")  # [S, Hkv, group, Dv]
    return out.div_(denominator[..., None]).view(num_seqs, num_heads, v_dim).to(dtype)


def _per_sequence(values: torch.Tensor, seq_index: torch.Tensor, num_seqs: int, reduce: str) -> torch.Tensor:
    """Reduce per-block ``values`` [B, ...] over each sequence's blocks: [S, ...] ("sum" or "amax")."""
    index = seq_index.view(-1, *[1] * (values.dim() - 1)).expand_as(values)
    initial = float("-inf") if reduce == "amax" else 0.0
    return values.new_full((num_seqs, *values.shape[1:]), initial).scatter_reduce_(0, index, values, reduce)


def gather_gqa(layer_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # K and V gathered apart, so each lands contiguous [B, Hkv, bs, D], the layout the
    # batched matmuls of a decode read without another copy.
    return layer_cache[:, 0].index_select(0, block_ids), layer_cache[:, 1].index_select(0, block_ids)


def mla_gather(v_dim: int) -> GatherKV:
    def gather(layer_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        latents = layer_cache.index_select(0, block_ids)[:, None]  # [B, 1, bs, L]
        return latents, latents[..., :v_dim]  # one KV head: latents are the keys, their head the values

    return gather


class TorchBackend(Backend):
    name = "torch"
    reads_fp8_kv = True  # gathered blocks are upcast to the query's dtype (exact from FP8)

    def logits(self, hidden, lm_head):
        # (lm_head · hiddenᵀ)ᵀ, a transposed view: with few rows MKL splits this orientation
        # over the vocabulary across threads, where hidden · lm_headᵀ scales poorly (32 rows,
        # vocab 32000: 10 ms instead of 15.7 on 2 cores).
        return F.linear(lm_head, hidden).t().float()

    def rms_norm(self, x, weight, eps, residual=None):
        if residual is not None:
            x = x + residual
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(x.dtype), x

    def rotary(self, x, positions, cos_sin, interleaved):
        cos, sin = cos_sin[positions].float().chunk(2, dim=-1)  # [T, D/2] each
        cos, sin = cos[:, None, :], sin[:, None, :]
        xf = x.float()
        if interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = xf.chunk(2, dim=-1)
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return rotated.to(x.dtype)

    def write_kv(self, layer_cache, k, v, slot_mapping):
        block_size = layer_cache.shape[3]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        # Token-major views [N, block_size, Hkv, D] put the two indices side by side (fast path).
        layer_cache[:, 0].transpose(1, 2)[blocks, offsets] = k
        layer_cache[:, 1].transpose(1, 2)[blocks, offsets] = v

    def paged_attention(self, q, layer_cache, meta, scale):
        def decode(q_decodes: torch.Tensor) -> torch.Tensor:
            return decode_attention(q_decodes, layer_cache, meta, scale, gather_gqa)

        return attend_cached(q, layer_cache, meta, scale, gather_gqa, decode)

    def write_latent(self, layer_cache, latent, slot_mapping):
        block_size = layer_cache.shape[1]
        layer_cache[slot_mapping // block_size, slot_mapping % block_size] = latent

    def mla_attention(self, q, layer_cache, meta, scale, v_dim):
        gather = mla_gather(v_dim)

        def decode(q_decodes: torch.Tensor) -> torch.Tensor:
            return decode_attention(q_decodes, layer_cache, meta, scale, gather)

        return attend_cached(q, layer_cache, meta, scale, gather, decode)

    def route(self, router_logits, config, correction_bias):
        logits = router_logits.float()
        scores = torch.sigmoid(logits) if config.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if config.num_groups > 1:
            num_tokens, num_experts = choice.shape
            grouped = choice.view(num_tokens, config.num_groups, num_experts // config.num_groups)
            if config.group_score == "top2_sum":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.max(dim=-1).values
            keep = group_scores.topk(config.topk_groups, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
            choice = choice.masked_fill(~expert_mask, float("-inf"))
        expert_ids = choice.topk(config.top_k, dim=-1).indices
        weights = scores.gather(1, expert_ids)
        if config.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * config.scaling_factor, expert_ids

    def dispatch(self, hidden, weights, expert_ids, num_experts):
        flat_ids = expert_ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=num_experts)
        offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=hidden.device)
        offsets[1:] = torch.cumsum(counts, dim=0)
        token_index = order // expert_ids.shape[1]
        return DispatchedTokens(
            hidden=hidden[token_index],
            expert_offsets=offsets,
            token_index=token_index,
            weights=weights.flatten()[order],
        )

    def expert_mlp(self, tokens, w13, w2):
        out = torch.empty_like(tokens.hidden)
        offsets = tokens.expert_offsets.tolist()
        for expert, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
            if start == end:
                continue
            gate, up = (tokens.hidden[start:end] @ w13[expert].t()).chunk(2, dim=-1)
            out[start:end] = self.silu_mul(gate, up) @ w2[expert].t()
        return out

    def combine(self, expert_out, tokens, num_tokens):
        weighted = expert_out.float() * tokens.weights[:, None]
        out = torch.zeros(num_tokens, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
        out.index_add_(0, tokens.token_index, weighted)
        return out.to(expert_out.dtype)
