"""MoE routing (softmax; DeepSeek-V3 sigmoid grouped top-k with bias) against ``TorchBackend.route``.

Logits are distinct within each token (a shuffled ladder plus a random offset): with ties the
choice between equal experts is unspecified in torch.topk itself, so no kernel could match it.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.backend import MoERouting
from pdserve.kernels.moe_routing import route
from pdserve.kernels.torch_backend import TorchBackend
from tests.kernels.helpers import DTYPES, assert_close

CONFIGS = {
    "mixtral": (MoERouting(top_k=2), 8, False),
    "qwen-60-no-renorm": (MoERouting(top_k=4, renormalize=False), 60, False),
    "v3-top2-sum-bias": (
        MoERouting(top_k=4, scoring="sigmoid", num_groups=4, topk_groups=2, group_score="top2_sum", scaling_factor=2.5),
        32,
        True,
    ),
    "v2-group-max": (MoERouting(top_k=3, num_groups=4, topk_groups=3, scaling_factor=16.0), 24, False),
    "sigmoid-ungrouped": (MoERouting(top_k=2, scoring="sigmoid"), 16, True),
}


def distinct_logits(num_tokens: int, num_experts: int) -> torch.Tensor:
    rows = [(torch.randperm(num_experts) - num_experts / 2) / 4 + torch.rand(()) / 64 for _ in range(num_tokens)]
    return torch.stack(rows) if rows else torch.empty(0, num_experts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("num_tokens", [0, 1, 9])
def test_route_matches_reference(dtype, name, num_tokens):
    config, num_experts, with_bias = CONFIGS[name]
    logits = distinct_logits(num_tokens, num_experts).to(dtype)
    bias = torch.randn(num_experts) / 4 if with_bias else None
    weights = torch.full((num_tokens, config.top_k), float("nan"))
    ids = torch.full((num_tokens, config.top_k), -1, dtype=torch.int64)
    route(logits, config, bias, out=(weights, ids))
    if num_tokens == 0 and config.num_groups > 1:
        # TorchBackend.route cannot take an empty batch when grouped (`view(0, G, -1)` is
        # ambiguous); the kernel must simply produce empty results.
        return
    want_weights, want_ids = TorchBackend().route(logits, config, bias)
    assert torch.equal(ids, want_ids), f"{name}: {ids} != {want_ids}"
    assert_close(weights, want_weights, name)


def test_route_rejects_unknown_scoring():
    with pytest.raises(ValueError):
        route(torch.randn(2, 8), MoERouting(top_k=2, scoring="relu"), None)
