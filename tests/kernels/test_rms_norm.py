"""RMSNorm (with and without the fused residual add) against ``TorchBackend.rms_norm``."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.torch_backend import TorchBackend
from tests.kernels.helpers import DTYPES, assert_close, poisoned


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 7])
@pytest.mark.parametrize("width", [64, 96, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, num_tokens, width, with_residual):
    x = torch.randn(num_tokens, width).to(dtype)
    weight = (1 + torch.randn(width) / 4).to(dtype)
    residual = torch.randn(num_tokens, width).to(dtype) if with_residual else None
    out, res_out = poisoned(x.shape, dtype), poisoned(x.shape, dtype)
    got, got_res = rms_norm(x, weight, 1e-6, residual, out=out, residual_out=res_out)
    want, want_res = TorchBackend().rms_norm(x, weight, 1e-6, residual)
    assert got.dtype == want.dtype
    assert_close(got, want, f"width={width}")
    if with_residual:
        # The sum is one rounding of exact inputs: it must be bit-identical.
        assert torch.equal(got_res, want_res)
    else:
        assert got_res is x


def test_rms_norm_float32_weight_on_bf16_input_promotes():
    x = torch.randn(3, 4, 96).to(torch.bfloat16)  # 3-D input: normalised over the last dim
    weight = 1 + torch.randn(96) / 4
    got, _ = rms_norm(x, weight, 1e-5)
    want, _ = TorchBackend().rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert_close(got, want)
