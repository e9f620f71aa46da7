"""MoE routing: scores, optional grouped selection with correction bias, top-k, renormalise.

One program per token holds all its expert scores as a [groups, experts per group] tile
(one group when routing is not grouped). It covers softmax routing (Mixtral, Qwen-MoE,
DeepSeek-V2) and DeepSeek-V3's sigmoid routing: the correction bias shifts which groups and
experts are chosen but the weights come from the unbiased scores. Top-k is k rounds of
argmax in descending order, as ``torch.topk``; ties go to the lower expert index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.backend import MoERouting
from pdserve.kernels.triton_mode import interpreted

interpreted()  # before any @triton.jit below: raises where they would be compiled for a missing GPU

_SCORINGS = {"softmax": 0, "sigmoid": 1}
_GROUP_SCORES = {"max": 0, "top2_sum": 1}


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    stride_lt,
    num_experts,
    group_size,
    num_groups,
    scaling,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr,
    TOP2_SUM: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    g_idx = tl.arange(0, BLOCK_G)[:, None]
    j_idx = tl.arange(0, BLOCK_GS)[None, :]
    expert = g_idx * group_size + j_idx  # [BLOCK_G, BLOCK_GS]
    valid = (g_idx < num_groups) & (j_idx < group_size)
    x = tl.load(logits_ptr + tok * stride_lt + expert, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        e = tl.exp(x - tl.max(tl.max(x, axis=1), axis=0))
        scores = e / tl.sum(tl.sum(e, axis=1), axis=0)
    scores = tl.where(valid, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if GROUPED:
        best = tl.max(choice, axis=1)  # [BLOCK_G]
        if TOP2_SUM:
            # The second best: mask the first occurrence of the best, take the max again.
            first = tl.min(tl.where(choice == best[:, None], j_idx, BLOCK_GS), axis=1)
            second = tl.max(tl.where(j_idx == first[:, None], float("-inf"), choice), axis=1)
            group_score = best + second
        else:
            group_score = best
        g_vec = tl.arange(0, BLOCK_G)
        group_score = tl.where(g_vec < num_groups, group_score, float("-inf"))
        keep = tl.zeros([BLOCK_G], tl.int1)
        for _ in tl.static_range(TOPK_GROUPS):
            top = tl.max(group_score, axis=0)
            pick = tl.min(tl.where(group_score == top, g_vec, BLOCK_G), axis=0)
            keep = keep | (g_vec == pick)
            group_score = tl.where(g_vec == pick, float("-inf"), group_score)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    k_vec = tl.arange(0, BLOCK_K)
    top_weights = tl.zeros([BLOCK_K], tl.float32)
    top_ids = tl.zeros([BLOCK_K], tl.int64)
    big = BLOCK_G * BLOCK_GS
    for k in tl.static_range(TOP_K):
        top = tl.max(tl.max(choice, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(choice == top, expert, big), axis=1), axis=0)
        weight = tl.sum(tl.sum(tl.where(expert == pick, scores, 0.0), axis=1), axis=0)
        top_weights = tl.where(k_vec == k, weight, top_weights)
        top_ids = tl.where(k_vec == k, pick.to(tl.int64), top_ids)
        choice = tl.where(expert == pick, float("-inf"), choice)
    if RENORMALIZE:
        top_weights = top_weights / (tl.sum(top_weights, axis=0) + 1e-20)
    k_mask = k_vec < TOP_K
    tl.store(weights_ptr + tok * TOP_K + k_vec, top_weights * scaling, mask=k_mask)
    tl.store(ids_ptr + tok * TOP_K + k_vec, top_ids, mask=k_mask)


def route(
    router_logits: torch.Tensor,
    config: MoERouting,
    correction_bias: torch.Tensor | None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick experts for logits [T, E]: returns (weights [T, top_k] float32, expert ids [T, top_k] int64).

    ``out`` may give the two (contiguous) result tensors to write into.
    """
    if config.scoring not in _SCORINGS:
        raise ValueError(f"unknown scoring {config.scoring!r}")
    if config.group_score not in _GROUP_SCORES:
        raise ValueError(f"unknown group_score {config.group_score!r}")
    num_tokens, num_experts = router_logits.shape
    grouped = config.num_groups > 1
    if num_experts % config.num_groups:
        raise ValueError(f"{num_experts} experts do not split into {config.num_groups} groups")
    num_groups = config.num_groups if grouped else 1
    group_size = num_experts // num_groups
    if out is None:
        weights = torch.empty(num_tokens, config.top_k, dtype=torch.float32, device=router_logits.device)
        ids = torch.empty(num_tokens, config.top_k, dtype=torch.int64, device=router_logits.device)
    else:
        weights, ids = out
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    if num_tokens:
        bias = correction_bias if correction_bias is not None else logits  # unused when None
        _route_kernel[(num_tokens,)](
            logits,
            bias,
            weights,
            ids,
            logits.stride(0),
            num_experts,
            group_size,
            num_groups,
            config.scaling_factor,
            SIGMOID=config.scoring == "sigmoid",
            HAS_BIAS=correction_bias is not None,
            GROUPED=grouped,
            TOP2_SUM=config.group_score == "top2_sum",
            TOPK_GROUPS=config.topk_groups,
            TOP_K=config.top_k,
            RENORMALIZE=config.renormalize,
            BLOCK_G=triton.next_power_of_2(num_groups),
            BLOCK_GS=triton.next_power_of_2(group_size),
            BLOCK_K=triton.next_power_of_2(config.top_k),
        )
    return weights, ids
