"""The shared kernel helpers: round-to-nearest-even bf16 casts in and out of the interpreter."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.common import cast, dot_block
from tests.kernels import helpers  # noqa: F401  (TRITON_INTERPRET before the kernels import)


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    idx = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + idx, mask=idx < n)
    tl.store(out_ptr + idx, cast(x, out_ptr.dtype.element_ty), mask=idx < n)


def test_bf16_cast_rounds_like_torch():
    # Random values, exact halfway cases (ties to even both ways), and the special values.
    base = torch.randn(200) * torch.logspace(-30, 30, 200)
    halfway = (torch.arange(1, 41, dtype=torch.float32) * 2**-7 + 1) + 2**-8  # 1 + k/128 + 1/256
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.3895e38, -1e-40, 1e-42])
    x = torch.cat([base, halfway, special])
    out = torch.full(x.shape, float("nan"), dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    assert torch.equal(out.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def test_bf16_cast_keeps_nan():
    x = torch.tensor([float("nan"), 1.0])
    out = torch.zeros(2, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, out, 2, BLOCK=2)
    assert torch.isnan(out[0]) and out[1] == 1.0


def test_dot_block_is_a_power_of_two_at_least_16():
    assert [dot_block(n) for n in (1, 16, 17, 96, 512)] == [16, 16, 32, 128, 512]
    assert dot_block(128, cap=64) == 64
