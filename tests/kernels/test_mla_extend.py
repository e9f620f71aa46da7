"""Absorbed MLA prefill/extend over the paged latent cache against ``TorchBackend.mla_attention``."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.mla_extend import mla_extend_attention
from pdserve.kernels.torch_backend import TorchBackend
from tests.kernels.helpers import DTYPES, assert_close, make_metadata, mla_cache, poisoned

CASES = [(16, 16), (17, 17), (40, 7), (50, 37), (33, 1), (9, 0), (1, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,latent_dim,v_dim", [(2, 576, 512), (4, 48, 40), (3, 32, 32)])
def test_mla_extend_matches_reference(dtype, num_heads, latent_dim, v_dim):
    block_size = 16
    seq_lens, query_lens = [c[0] for c in CASES], [c[1] for c in CASES]
    num_blocks = sum(-(-s // block_size) for s in seq_lens)
    meta = make_metadata(seq_lens, query_lens, block_size, num_blocks)
    assert meta.num_decodes == 0
    cache = mla_cache(num_blocks, block_size, latent_dim, dtype)
    q = torch.randn(sum(query_lens), num_heads, latent_dim).to(dtype)
    out = poisoned((q.shape[0], num_heads, v_dim), dtype)
    mla_extend_attention(
        q,
        cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        0,
        meta.num_seqs,
        meta.max_query_len,
        0.1,
        v_dim,
        out,
    )
    assert_close(out, TorchBackend().mla_attention(q, cache, meta, 0.1, v_dim), f"L={latent_dim} v={v_dim}")
