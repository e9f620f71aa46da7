"""Paged GQA prefill/extend attention against ``TorchBackend.paged_attention``."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.paged_extend import paged_extend_attention
from pdserve.kernels.torch_backend import TorchBackend
from tests.kernels.helpers import DTYPES, assert_close, gqa_cache, make_metadata, poisoned

# (context, new tokens): whole prompts ending on / just past a block, a prefix-cache hit, a
# chunk longer than the kernel's query tile, a one-token extension after them, an empty query.
CASES = [(16, 16), (17, 17), (40, 7), (70, 45), (33, 1), (9, 0), (1, 1)]


def _run(dtype, num_heads, num_kv_heads, head_dim, cases, block_size=16):
    seq_lens, query_lens = [c[0] for c in cases], [c[1] for c in cases]
    # Lead with a multi-token sequence so that no sequence counts as a decode.
    assert query_lens[0] != 1
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    meta = make_metadata(seq_lens, query_lens, block_size, num_blocks)
    assert meta.num_decodes == 0
    cache = gqa_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype)
    q = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = poisoned(q.shape, dtype)
    paged_extend_attention(
        q,
        cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        0,
        meta.num_seqs,
        meta.max_query_len,
        scale,
        out,
    )
    assert_close(out, TorchBackend().paged_attention(q, cache, meta, scale), f"cases={cases}")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (8, 2, 128), (6, 1, 96)])
def test_extend_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    _run(dtype, num_heads, num_kv_heads, head_dim, CASES)


@pytest.mark.parametrize("block_size", [1, 48])
def test_extend_with_other_block_sizes(block_size):
    _run(torch.float32, 4, 2, 64, [(20, 20), (50, 3), (49, 49)], block_size)


# A step of decodes only (no extends at all), and one whose extends have empty queries.
@pytest.mark.parametrize("query_lens,num_extends", [([1, 1], 0), ([1, 1, 0], 1)])
def test_extend_of_no_queries_writes_nothing(query_lens, num_extends):
    seq_lens = [5, 9, 7][: len(query_lens)]
    meta = make_metadata(seq_lens, query_lens, 16, 4)
    num_decodes = meta.num_seqs - num_extends
    q = torch.randn(sum(query_lens), 2, 64)
    out = poisoned(q.shape, torch.float32)
    paged_extend_attention(
        q,
        gqa_cache(4, 1, 16, 64, torch.float32),
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        num_decodes,
        num_extends,
        max(query_lens[num_decodes:], default=0),
        1.0,
        out,
    )
    assert out.numel() and out.isnan().all(), "the decodes' rows were written"
