"""Rotary embedding, NeoX and interleaved, against ``TorchBackend.rotary``."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.rotary import rotary
from pdserve.kernels.torch_backend import TorchBackend
from tests.kernels.helpers import DTYPES, assert_close, poisoned


def _cos_sin(max_pos: int, dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("num_tokens,num_heads,dim", [(0, 2, 64), (1, 1, 64), (5, 3, 96), (4, 16, 64)])
def test_rotary_matches_reference(dtype, interleaved, num_tokens, num_heads, dim):
    x = torch.randn(num_tokens, num_heads, dim).to(dtype)
    positions = torch.randint(0, 100, (num_tokens,))
    cos_sin = _cos_sin(100, dim)
    out = poisoned(x.shape, dtype)
    got = rotary(x, positions, cos_sin, interleaved, out=out)
    assert_close(got, TorchBackend().rotary(x, positions, cos_sin, interleaved))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_of_a_strided_slice(interleaved):
    # DeepSeek rotates only the last 64 dims of each query head: a non-contiguous view.
    q = torch.randn(6, 4, 192)
    rope = q[..., 128:]
    positions = torch.randint(0, 50, (6,))
    cos_sin = _cos_sin(50, 64).to(torch.bfloat16)  # a bf16 table is upcast, as in the reference
    assert_close(
        rotary(rope, positions, cos_sin, interleaved), TorchBackend().rotary(rope, positions, cos_sin, interleaved)
    )
