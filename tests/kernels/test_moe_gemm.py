"""Grouped expert GEMMs with fused SiLU-and-multiply against ``TorchBackend.expert_mlp``."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.moe_gemm import expert_mlp
from pdserve.kernels.torch_backend import TorchBackend
from tests.kernels.helpers import DTYPES, assert_close, poisoned
from tests.kernels.test_moe_align import random_choice


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,hidden,inter", [(1, 4, 1, 64, 32), (21, 8, 2, 96, 40), (40, 6, 3, 64, 160)]
)
def test_expert_mlp_matches_reference(dtype, num_tokens, num_experts, top_k, hidden, inter):
    ref = TorchBackend()
    x = torch.randn(num_tokens, hidden).to(dtype)
    ids = random_choice(num_tokens, num_experts, top_k)
    tokens = ref.dispatch(x, torch.rand(num_tokens, top_k), ids, num_experts)
    # Scaled so that activations stay O(1) and bf16 tolerances are meaningful.
    w13 = (torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter) / inter**0.5).to(dtype)
    out = poisoned(tokens.hidden.shape, dtype)
    got = expert_mlp(tokens, w13, w2, out=out)
    assert_close(got, ref.expert_mlp(tokens, w13, w2), f"E={num_experts} I={inter}")


def test_expert_mlp_of_no_rows():
    ref = TorchBackend()
    tokens = ref.dispatch(torch.empty(0, 64), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int64), 4)
    got = expert_mlp(tokens, torch.randn(4, 64, 64), torch.randn(4, 64, 32))
    assert got.shape == (0, 64)
