"""The reference backend: plain torch, on CPU or GPU.

Written for clarity first; the Triton kernels are checked against these functions. The
attention here gathers each sequence's blocks and runs torch's SDPA: decodes as one padded
batch, every other sequence on its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.engine.backend import AttentionMetadata, Backend, DispatchedTokens


def _gather_blocks(layer_cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """The blocks covering ``length`` tokens of each sequence: [S, nb, ...] (one contiguous copy)."""
    num_blocks = -(-length // _block_size(layer_cache))
    return layer_cache[block_tables[:, :num_blocks].long()]


def _block_size(layer_cache: torch.Tensor) -> int:
    # GQA layer views are [N, 2, Hkv, block_size, D]; MLA views [N, block_size, L].
    return layer_cache.shape[3] if layer_cache.dim() == 5 else layer_cache.shape[1]


# (layer cache, block tables [S, nb], length) → k [S, Hkv, length, D], v [S, Hkv, length, Dv]
GatherKV = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def _attend_cached(
    q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float, gather_kv: GatherKV
) -> torch.Tensor:
    """Causal attention of every sequence's new tokens over its cached context, with SDPA.

    Decodes run as one padded batch; longer queries one sequence at a time, with a
    bottom-right causal mask when part of the context was cached before this step.
    """
    nd = meta.num_decodes
    parts = []
    if nd:
        k, v = gather_kv(layer_cache, meta.block_tables[:nd], max(meta.seq_lens_list[:nd]))
        mask = torch.arange(k.shape[2], device=q.device)[None, :] < meta.seq_lens[:nd, None]
        out = F.scaled_dot_product_attention(
            q[:nd, :, None, :], k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        parts.append(out[:, :, 0])
    start = nd
    for i in range(nd, meta.num_seqs):
        qlen, seq_len = meta.query_lens_list[i], meta.seq_lens_list[i]
        k, v = gather_kv(layer_cache, meta.block_tables[i : i + 1], seq_len)
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


def _gather_gqa(layer_cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = _gather_blocks(layer_cache, block_tables, length)  # [S, nb, 2, Hkv, bs, D]
    kv = blocks.permute(2, 0, 3, 1, 4, 5).flatten(3, 4)[..., :length, :]  # [2, S, Hkv, nb*bs, D]
    return kv[0], kv[1]


def _mla_gather(v_dim: int) -> GatherKV:
    def gather(layer_cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = _gather_blocks(layer_cache, block_tables, length).flatten(1, 2)[:, None, :length]  # [S, 1, T, L]
        return rows, rows[..., :v_dim]  # one KV head: latents are the keys, their head the values

    return gather


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
        return _attend_cached(q, layer_cache, meta, scale, _gather_gqa)

    def write_latent(self, layer_cache, latent, slot_mapping):
        block_size = layer_cache.shape[1]
        layer_cache[slot_mapping // block_size, slot_mapping % block_size] = latent

    def mla_attention(self, q, layer_cache, meta, scale, v_dim):
        return _attend_cached(q, layer_cache, meta, scale, _mla_gather(v_dim))

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
