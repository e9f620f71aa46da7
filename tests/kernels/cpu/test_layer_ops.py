"""``layer_ops.c`` against ``TorchBackend``: RMSNorm with and without its residual, rotary
embedding fused with the KV cache write, and SwiGLU's activation, through ``CpuBackend`` as
the models call them. The largest sizes are a prompt's, which the C code splits over threads."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.layers import rope_cos_sin
from pdserve.kernels.cpu import layer_ops
from pdserve.kernels.cpu.cpu_backend import CpuBackend
from pdserve.kernels.torch_backend import TorchBackend
from tests.kernels.helpers import assert_close


@pytest.mark.parametrize("num_tokens", [1, 3, 70, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(num_tokens, with_residual):
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, 2 * 576)[:, :576]  # a column slice: rows contiguous, stride wider
    residual = torch.randn(num_tokens, 576) if with_residual else None
    weight = torch.randn(576)
    got, got_sum = CpuBackend().rms_norm(x, weight, 1e-5, residual)
    want, want_sum = TorchBackend().rms_norm(x, weight, 1e-5, residual)
    assert_close(got, want)
    assert torch.equal(got_sum, want_sum)


@pytest.mark.parametrize("num_tokens", [1, 4, 33, 200])
def test_rope_write_kv_matches_reference(num_tokens):
    torch.manual_seed(num_tokens)
    heads, kv_heads, dim, block_size, num_blocks = 9, 3, 64, 16, 16
    q, k, v = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim).split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    q, k, v = q.view(num_tokens, heads, dim), k.view(num_tokens, kv_heads, dim), v.view(num_tokens, kv_heads, dim)
    cos_sin = rope_cos_sin(dim, 100000.0, None, 256, torch.device("cpu"))
    positions = torch.randint(0, 256, (num_tokens,))
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    caches = [torch.randn(num_blocks, 2, kv_heads, block_size, dim) for _ in range(2)]
    caches[1].copy_(caches[0])
    want = TorchBackend().rope_write_kv(q.clone(), k, v, positions, cos_sin, caches[0], slots)
    got = CpuBackend().rope_write_kv(q.clone(), k, v, positions, cos_sin, caches[1], slots)
    assert_close(got, want)
    assert_close(caches[1], caches[0])  # written slots match, and nothing else moved


@pytest.mark.parametrize("num_tokens", [1, 2000])
def test_rope_write_kv_refuses_a_slot_outside_the_cache_and_writes_nothing(num_tokens):
    q, k, v = torch.randn(num_tokens, 2, 64), torch.randn(num_tokens, 1, 64), torch.randn(num_tokens, 1, 64)
    cos_sin = rope_cos_sin(64, 10000.0, None, 16, torch.device("cpu"))
    cache = torch.zeros(125, 2, 1, 16, 64)
    slots = torch.arange(num_tokens)
    slots[-1] = 125 * 16  # the last token's slot is one past the cache
    with pytest.raises(ValueError, match="slot outside the cache"):
        CpuBackend().rope_write_kv(q, k, v, torch.full((num_tokens,), 3), cos_sin, cache, slots)
    assert not cache.any()


@pytest.mark.parametrize("num_tokens", [0, 1, 5, 100])
def test_silu_mul_matches_reference(num_tokens):
    torch.manual_seed(num_tokens)
    gate, up = (torch.randn(num_tokens, 2 * 1536) * 4).chunk(2, dim=-1)  # halves of a fused projection
    if num_tokens:
        gate[0, :6] = torch.tensor([-1e4, -100.0, -88.0, 88.0, 100.0, 1e4])  # exp(-x) would overflow
    got = CpuBackend().silu_mul(gate, up)
    assert_close(got, TorchBackend().silu_mul(gate, up))
    assert got.shape == (num_tokens, 1536) and got.is_contiguous()


def test_silu_mul_refuses_mismatched_halves():
    with pytest.raises(ValueError, match="gate .* and up .* must be"):
        layer_ops.silu_mul(torch.randn(3, 8), torch.randn(3, 9))
