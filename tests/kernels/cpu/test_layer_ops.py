"""``layer_ops.c`` against ``TorchBackend``: RMSNorm with and without its residual, rotary
embedding fused with the KV cache write, SwiGLU's activation, through ``CpuBackend`` as the
models call them, and greedy sampling's argmax against torch's. The largest sizes are a
prompt's, which the C code splits over threads."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels.cpu import layer_ops
from pdserve.kernels.cpu.cpu_backend import CpuBackend
from pdserve.kernels.torch_backend import TorchBackend
from pdserve.model.nn.layers import rope_cos_sin
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
    q, k, v = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim).split(
        [heads * dim, kv_heads * dim, kv_heads * dim], -1
    )
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


@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 15), (32, 49152), (5, 1000), (70, 16)])
def test_argmax_matches_torch(rows, vocab):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(CpuBackend().argmax(logits), logits.argmax(dim=-1))


def test_argmax_takes_the_first_of_equals_and_a_nan_as_largest():
    logits = torch.zeros(4, 100)
    logits[0, [17, 40, 99]] = 2.0  # equals in different lanes and in the scalar tail
    logits[1, [96, 97]] = 1.0  # only in the tail
    logits[2].fill_(-math.inf)
    logits[3, [5, 50]] = 3.0
    logits[3, [60, 70]] = math.nan  # NaN beats everything: the first one
    assert layer_ops.argmax(logits).tolist() == [17, 96, 0, 60] == logits.argmax(dim=-1).tolist()
    wide = torch.zeros(2, 64)
    wide[0, [33, 1]] = 1.0  # the same lane (1 and 33 are 32 apart): its first
    wide[1, [19, 2]] = 1.0  # different lanes: the lowest column
    assert layer_ops.argmax(wide).tolist() == [1, 2]


def test_argmax_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="argmax takes float32"):
        layer_ops.argmax(torch.zeros(2, 8).double())
    with pytest.raises(ValueError, match="vocab > 0"):
        layer_ops.argmax(torch.zeros(2, 0))
    columns = torch.randn(3, 8).t()  # rows not contiguous: torch's argmax
    assert torch.equal(CpuBackend().argmax(columns), columns.argmax(dim=-1))
