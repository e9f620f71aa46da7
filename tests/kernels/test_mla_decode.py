"""Absorbed MLA decode over the paged latent cache against ``TorchBackend.mla_attention``."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.mla_decode import mla_decode_attention
from pdserve.kernels.torch_backend import TorchBackend
from tests.kernels.helpers import DTYPES, assert_close, make_metadata, mla_cache, poisoned

SEQ_LENS = [1, 16, 17, 70]


def _run(dtype, num_heads, latent_dim, v_dim, num_splits, seq_lens=SEQ_LENS, block_size=16):
    num_blocks = sum(-(-s // block_size) for s in seq_lens)
    meta = make_metadata(seq_lens, [1] * len(seq_lens), block_size, num_blocks)
    cache = mla_cache(num_blocks, block_size, latent_dim, dtype)
    q = torch.randn(len(seq_lens), num_heads, latent_dim).to(dtype)
    scale = 0.1
    out = poisoned((len(seq_lens), num_heads, v_dim), dtype)
    mla_decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale, v_dim, out, num_splits)
    assert_close(out, TorchBackend().mla_attention(q, cache, meta, scale, v_dim), f"L={latent_dim} v={v_dim}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,latent_dim,v_dim", [(4, 576, 512), (16, 48, 40), (3, 32, 32)])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_mla_decode_matches_reference(dtype, num_heads, latent_dim, v_dim, num_splits):
    _run(dtype, num_heads, latent_dim, v_dim, num_splits)


@pytest.mark.slow
def test_mla_decode_deepseek_v3_heads():
    # 128 heads over the 576-wide latent: several head tiles a sequence.
    _run(torch.bfloat16, 128, 576, 512, 2, seq_lens=[1, 65], block_size=64)
