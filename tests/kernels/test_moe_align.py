"""MoE dispatch (stable sort by expert + row gather) against ``TorchBackend.dispatch``."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.moe_align import dispatch, gather_rows
from pdserve.kernels.torch_backend import TorchBackend
from tests.kernels.helpers import DTYPES, poisoned


def random_choice(num_tokens: int, num_experts: int, top_k: int) -> torch.Tensor:
    """Distinct experts per token, drawn from the lower half so that some experts get none."""
    pool = max(top_k, num_experts // 2)
    return (
        torch.stack([torch.randperm(pool)[:top_k] for _ in range(num_tokens)])
        if num_tokens
        else torch.empty(0, top_k, dtype=torch.int64)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(0, 4, 2), (1, 4, 1), (13, 8, 2), (37, 60, 4), (300, 16, 6)])
def test_dispatch_matches_reference(dtype, num_tokens, num_experts, top_k):
    hidden = torch.randn(num_tokens, 96).to(dtype)
    weights = torch.rand(num_tokens, top_k)
    ids = random_choice(num_tokens, num_experts, top_k)
    got = dispatch(hidden, weights, ids, num_experts)
    want = TorchBackend().dispatch(hidden, weights, ids, num_experts)
    assert torch.equal(got.expert_offsets, want.expert_offsets)
    assert torch.equal(got.token_index, want.token_index)  # stable: same order within an expert
    assert torch.equal(got.hidden, want.hidden)
    assert torch.equal(got.weights, want.weights)
    # The pair → row map inverts the sort.
    rows = got.pair_rows.view(num_tokens, top_k)
    assert torch.equal(got.token_index[rows], torch.arange(num_tokens)[:, None].expand(-1, top_k))


def test_gather_rows_writes_every_element():
    src = torch.randn(10, 1500)  # wider than one column tile
    index = torch.tensor([9, 0, 0, 4])
    out = poisoned((4, 1500), torch.float32)
    assert torch.equal(gather_rows(src, index, out=out), src[index])
