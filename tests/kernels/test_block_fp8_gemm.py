"""The block-scaled FP8 GEMM against its torch reference (``block_fp8.block_fp8_linear``).

Exact: with small integer activations every FP8 product and every group's sum is an exact
float32 integer, so the summation order cannot matter and kernel and reference must agree
bit for bit — the rounding to FP8, the scales and their order of application included. With
random activations they differ only in the order of a group's sum.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import block_fp8
from pdserve.kernels.block_fp8 import FP8_DTYPE, BlockFP8Weight
from pdserve.kernels.block_fp8_gemm import block_fp8_linear, quantize_activations
from tests.kernels.helpers import DEVICE


def _weight(num_out: int, num_in: int, block_size: tuple[int, int], integer: bool) -> BlockFP8Weight:
    if integer:  # every integer in [-16, 16] is an FP8 value
        values = torch.randint(-16, 17, (num_out, num_in)).float()
    else:
        values = (torch.randn(num_out, num_in) * 100).clamp(-448, 448)
    scales = torch.rand(*block_fp8.expected_scale_shape((num_out, num_in), block_size)) / 64 + 1e-3
    return BlockFP8Weight(values.to(FP8_DTYPE), scales, block_size)


# Blocks that divide nothing (partial edge blocks), a non-power-of-two group, DeepSeek's 128 x 128.
SHAPES = [(5, 72, 40, (16, 16)), (1, 96, 200, (24, 40)), (33, 160, 256, (128, 128)), (17, 64, 90, (32, 48))]


@pytest.mark.parametrize("num_rows,num_out,num_in,block_size", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_is_exact_against_the_reference_on_exact_sums(num_rows, num_out, num_in, block_size, dtype):
    x = torch.randint(-8, 9, (num_rows, num_in)).to(dtype)
    x[0, : block_size[1]] = 0  # an all-zero group: scale 1, not 0/0
    weight = _weight(num_out, num_in, block_size, integer=True)
    bias = torch.randn(num_out).to(dtype)
    got = block_fp8_linear(x, weight, bias)
    want = block_fp8.block_fp8_linear(x, weight, bias)
    assert got.dtype == dtype and got.shape == (num_rows, num_out)
    if DEVICE == "cpu":  # the interpreter: the same arithmetic, bit for bit
        assert torch.equal(got, want), (got - want).abs().max()
    else:  # a GPU's FP8 MMA accumulates in its own order and precision
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("num_rows,num_out,num_in,block_size", SHAPES[:2])
def test_gemm_matches_the_reference_on_random_values(num_rows, num_out, num_in, block_size):
    x = torch.randn(num_rows, 3, num_in)  # leading dims are flattened and restored
    weight = _weight(num_out, num_in, block_size, integer=False)
    got = block_fp8_linear(x, weight)
    want = block_fp8.block_fp8_linear(x, weight)
    assert got.shape == (num_rows, 3, num_out)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # and it is a close approximation of the unquantized product
    exact = x @ weight.dequantize(torch.float32).T
    assert ((got - exact).norm() / exact.norm()).item() < 0.05


def test_activation_quantization_rounds_as_torch_does():
    x = torch.randn(7, 100) * torch.logspace(-4, 3, 100)  # magnitudes across FP8's normal and subnormal range
    x[2, :40] = 0
    got_q, got_scale = quantize_activations(x, 40)
    want_q, want_scale = block_fp8.quantize_activations(x, 40)
    assert torch.equal(got_scale, want_scale) and got_scale[2, 0] == 1
    assert torch.equal(got_q.float(), want_q.float())


def test_no_rows():
    weight = _weight(32, 64, (16, 16), integer=True)
    assert block_fp8_linear(torch.empty(0, 64), weight).shape == (0, 32)
