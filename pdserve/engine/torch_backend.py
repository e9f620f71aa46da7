"""The reference backend: plain torch, on CPU or GPU.

Written for clarity first; the Triton kernels are checked against these functions. The
attention here gathers each sequence's blocks and runs torch's SDPA: decodes as one padded
batch, every other sequence on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.backend import AttentionMetadata, Backend, DispatchedTokens, RouterConfig


def _gather(layer_cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Context rows of each sequence, padded to ``length``: [S, length, ...] from [N, block_size, ...]."""
    num_blocks = -(-length // layer_cache.shape[1])
    blocks = layer_cache[block_tables[:, :num_blocks].long()]  # [S, nb, block_size, ...]
    return blocks.flatten(1, 2)[:, :length]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [S, Tq, H, D], k [S, Tk, Hkv, D], v [S, Tk, Hkv, Dv], mask [S, Tq, Tk] (True = attend)
    → [S, Tq, H, Dv]. Scores are computed in float32 whatever the cache dtype."""
    dtype = q.dtype
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))  # [S, heads, tokens, dim]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if mask is None else mask[:, None], scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(1, 2).to(dtype)


def _attend_cached(
    q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float, split_kv
) -> torch.Tensor:
    """Causal attention of every sequence's new tokens over its cached context.

    ``layer_cache`` is token-major ([N, block_size, ...]); ``split_kv`` turns gathered rows
    [S, Tk, ...] into (k [S, Tk, Hkv, D], v [S, Tk, Hkv, Dv]). Decodes run as one padded
    batch; longer queries one sequence at a time, each with a bottom-right causal mask.
    """
    nd = meta.num_decodes
    parts = []
    if nd:
        lengths = meta.seq_lens[:nd]
        k, v = split_kv(_gather(layer_cache, meta.block_tables[:nd], max(meta.seq_lens_list[:nd])))
        mask = torch.arange(k.shape[1], device=q.device)[None, None, :] < lengths[:, None, None]
        parts.append(_sdpa(q[:nd, None], k, v, mask, scale)[:, 0])
    start = nd
    for i in range(nd, meta.num_seqs):
        qlen, seq_len = meta.query_lens_list[i], meta.seq_lens_list[i]
        k, v = split_kv(_gather(layer_cache, meta.block_tables[i : i + 1], seq_len))
        key_pos = torch.arange(seq_len, device=q.device)
        query_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
        mask = (key_pos[None, :] <= query_pos[:, None])[None]
        parts.append(_sdpa(q[None, start : start + qlen], k, v, mask, scale)[0])
        start += qlen
    return torch.cat(parts) if len(parts) > 1 else parts[0]


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
        # Token-major views [N, block_size, Hkv, D] put the two indices side by side (fast path).
        layer_cache[:, 0].transpose(1, 2)[blocks, offsets] = k
        layer_cache[:, 1].transpose(1, 2)[blocks, offsets] = v

    def paged_attention(self, q, layer_cache, meta, scale):
        # Token-major view of the cache: [N, block_size, 2, Hkv, D].
        cache = layer_cache.permute(0, 3, 1, 2, 4)
        return _attend_cached(q, cache, meta, scale, lambda rows: (rows[:, :, 0], rows[:, :, 1]))

    def write_latent(self, layer_cache, latent, slot_mapping):
        block_size = layer_cache.shape[1]
        layer_cache[slot_mapping // block_size, slot_mapping % block_size] = latent

    def mla_attention(self, q, layer_cache, meta, scale, v_dim):
        # One KV head shared by all heads: the latent rows are the keys, their first v_dim
        # values the values.
        def split(rows):
            keys = rows[:, :, None, :]
            return keys, keys[..., :v_dim]

        return _attend_cached(q, layer_cache, meta, scale, split)

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
            out[start:end] = (F.silu(gate) * up) @ w2[expert].t()
        return out

    def combine(self, expert_out, tokens, num_tokens):
        weighted = expert_out.float() * tokens.weights[:, None]
        out = torch.zeros(num_tokens, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
        out.index_add_(0, tokens.token_index, weighted)
        return out.to(expert_out.dtype)
