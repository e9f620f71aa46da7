"""The reference backend: plain torch, on CPU or GPU.

Written for clarity first; the Triton kernels are checked against these functions. The
attention here runs decodes as one padded batch and every other sequence on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.backend import AttentionMetadata, Backend, DispatchedTokens, RouterConfig


def _gather_context(layer_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's cached rows, token-major: [length, ...] from a [N, block_size, ...] cache."""
    num_blocks = -(-length // layer_cache.shape[1])
    blocks = layer_cache[block_table[:num_blocks].long()]  # [nb, block_size, ...]
    return blocks.flatten(0, 1)[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int) -> torch.Tensor:
    """q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] → [Tq, H, Dv]; query i sees keys <= offset + i."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    qh = q.transpose(0, 1).float().unflatten(0, (num_kv_heads, group))  # [Hkv, G, Tq, D]
    kh = k.transpose(0, 1).float().unsqueeze(1)  # [Hkv, 1, Tk, D]
    vh = v.transpose(0, 1).float().unsqueeze(1)  # [Hkv, 1, Tk, Dv]
    scores = (qh @ kh.transpose(-1, -2)) * scale  # [Hkv, G, Tq, Tk]
    tq, tk = q.shape[0], k.shape[0]
    if tq > 1:
        key_pos = torch.arange(tk, device=q.device)
        query_pos = torch.arange(tq, device=q.device) + causal_offset
        scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vh  # [Hkv, G, Tq, Dv]
    return out.flatten(0, 1).transpose(0, 1).to(q.dtype)


def _batched_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [S, H, D], keys [S, Tk, Hkv, D], values [S, Tk, Hkv, Dv] padded; → [S, H, Dv]."""
    num_seqs, num_heads = q.shape[0], q.shape[1]
    num_kv_heads = keys.shape[2]
    group = num_heads // num_kv_heads
    qh = q.float().unflatten(1, (num_kv_heads, group))  # [S, Hkv, G, D]
    kh = keys.float().permute(0, 2, 3, 1)  # [S, Hkv, D, Tk]
    scores = (qh @ kh) * scale  # [S, Hkv, G, Tk]
    pad = torch.arange(keys.shape[1], device=q.device)[None, :] >= seq_lens[:, None]
    scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ values.float().transpose(1, 2)  # [S, Hkv, G, Dv]
    return out.reshape(num_seqs, num_heads, -1).to(q.dtype)


def _gather_batch(layer_cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """Padded context of every sequence: [S, max_len, ...] from a [N, block_size, ...] cache."""
    num_blocks = -(-max_len // layer_cache.shape[1])
    blocks = layer_cache[block_tables[:, :num_blocks].long()]  # [S, nb, block_size, ...]
    return blocks.flatten(1, 2)[:, :max_len]


class TorchBackend(Backend):
    name = "torch"

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
        layer_cache[blocks, 0, :, offsets] = k
        layer_cache[blocks, 1, :, offsets] = v

    def paged_attention(self, q, layer_cache, meta, scale):
        # Token-major view of the cache: [N, block_size, 2, Hkv, D].
        cache = layer_cache.permute(0, 3, 1, 2, 4)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            ctx = _gather_batch(cache, meta.block_tables[:nd], max(meta.seq_lens_list[:nd]))
            out[:nd] = _batched_decode(q[:nd], ctx[:, :, 0], ctx[:, :, 1], meta.seq_lens[:nd], scale)
        start = nd
        for i in range(nd, meta.num_seqs):
            qlen, seq_len = meta.query_lens_list[i], meta.seq_lens_list[i]
            ctx = _gather_context(cache, meta.block_tables[i], seq_len)
            out[start : start + qlen] = _attend(q[start : start + qlen], ctx[:, 0], ctx[:, 1], scale, seq_len - qlen)
            start += qlen
        return out

    def write_latent(self, layer_cache, latent, slot_mapping):
        block_size = layer_cache.shape[1]
        layer_cache[slot_mapping // block_size, slot_mapping % block_size] = latent

    def mla_attention(self, q, layer_cache, meta, scale, v_dim):
        out = q.new_empty(q.shape[0], q.shape[1], v_dim)
        nd = meta.num_decodes
        if nd:
            ctx = _gather_batch(layer_cache, meta.block_tables[:nd], max(meta.seq_lens_list[:nd]))
            keys = ctx[:, :, None, :]  # one KV head: [S, Tk, 1, L]
            out[:nd] = _batched_decode(q[:nd], keys, keys[..., :v_dim], meta.seq_lens[:nd], scale)
        start = nd
        for i in range(nd, meta.num_seqs):
            qlen, seq_len = meta.query_lens_list[i], meta.seq_lens_list[i]
            keys = _gather_context(layer_cache, meta.block_tables[i], seq_len)[:, None, :]
            out[start : start + qlen] = _attend(q[start : start + qlen], keys, keys[..., :v_dim], scale, seq_len - qlen)
            start += qlen
        return out

    def route(self, router_logits, config, correction_bias):
        logits = router_logits.float()
        scores = torch.sigmoid(logits) if config.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if config.num_groups > 1:
            num_tokens, num_experts = choice.shape
            grouped = choice.view(num_tokens, config.num_groups, -1)
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
            out[start:end] = (F.silu(gate) * up) @ w2[expert].t()
        return out

    def combine(self, expert_out, tokens, num_tokens):
        weighted = expert_out.float() * tokens.weights[:, None]
        out = torch.zeros(num_tokens, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
        out.index_add_(0, tokens.token_index, weighted)
        return out.to(expert_out.dtype)
