"""MoE weighted combine (ordered and atomic paths) against ``TorchBackend.combine``."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.moe_align import dispatch
from pdserve.kernels.moe_combine import combine
from pdserve.kernels.torch_backend import TorchBackend
from tests.kernels.helpers import DTYPES, assert_close, poisoned
from tests.kernels.test_moe_align import random_choice


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,top_k,hidden", [(0, 2, 64), (1, 1, 64), (17, 4, 96), (9, 2, 1500)])
@pytest.mark.parametrize("from_triton_dispatch", [True, False])
def test_combine_matches_reference(dtype, num_tokens, top_k, hidden, from_triton_dispatch):
    ref = TorchBackend()
    x = torch.randn(num_tokens, hidden).to(dtype)
    weights, ids = torch.rand(num_tokens, top_k), random_choice(num_tokens, 8, top_k)
    # The Triton dispatch carries the pair → row map (ordered sum); the reference's does not
    # (atomic scatter-add). Both must give the reference's result.
    tokens = dispatch(x, weights, ids, 8) if from_triton_dispatch else ref.dispatch(x, weights, ids, 8)
    expert_out = torch.randn(num_tokens * top_k, hidden).to(dtype)
    out = poisoned((num_tokens, hidden), dtype)
    got = combine(expert_out, tokens, num_tokens, out=out)
    assert_close(got, ref.combine(expert_out, ref.dispatch(x, weights, ids, 8), num_tokens))
