"""Paged GQA decode attention (split-K + merge) against ``TorchBackend.paged_attention``."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.paged_decode import paged_decode_attention, split_plan
from pdserve.kernels.torch_backend import TorchBackend
from tests.kernels.helpers import DTYPES, assert_close, gqa_cache, make_metadata, poisoned

# Context 1, ending exactly on / just past a 16-token block, and longer ones for split-K.
SEQ_LENS = [1, 16, 17, 70, 33]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (8, 2, 128), (6, 1, 96), (12, 4, 64)])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_matches_reference(dtype, num_heads, num_kv_heads, head_dim, num_splits):
    block_size = 16
    meta = make_metadata(SEQ_LENS, [1] * len(SEQ_LENS), block_size, num_blocks=16)
    cache = gqa_cache(16, num_kv_heads, block_size, head_dim, dtype)
    q = torch.randn(len(SEQ_LENS), num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = poisoned(q.shape, dtype)
    paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale, out, num_splits)
    assert_close(out, TorchBackend().paged_attention(q, cache, meta, scale), f"splits={num_splits}")


@pytest.mark.parametrize("block_size", [1, 8, 48])
def test_decode_with_other_block_sizes(block_size):
    # Pages smaller and larger than the kernel's key tile; more splits than some sequences need.
    seq_lens = [1, block_size, block_size + 1, 90]
    num_blocks = sum(-(-s // block_size) for s in seq_lens)
    meta = make_metadata(seq_lens, [1] * 4, block_size, num_blocks)
    cache = gqa_cache(num_blocks, 2, block_size, 64, torch.float32)
    q = torch.randn(4, 4, 64)
    out = poisoned(q.shape, torch.float32)
    paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, 0.125, out, num_splits=5)
    assert_close(out, TorchBackend().paged_attention(q, cache, meta, 0.125))


def test_split_plan_covers_the_longest_context():
    for max_len in (1, 31, 32, 33, 4096):
        for wanted in (1, 3, 64, None):
            num_splits, per_split = split_plan(8, max_len, 32, wanted)
            assert per_split % 32 == 0 and num_splits * per_split >= max_len
            assert (num_splits - 1) * per_split < max_len  # no split is empty for the longest
