"""The C attention kernels against the torch reference: decodes (both cache layouts) and prompts."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu.paged_decode import paged_decode, paged_prefill
from pdserve.kernels.torch_backend import TorchBackend, decode_attention, gather_gqa, mla_gather
from tests.kernels.helpers import assert_close, gqa_cache, make_metadata, mla_cache


def _gqa(meta, q, cache, scale):
    keys, values = cache[:, 0], cache[:, 1]
    return paged_decode(q, keys, values, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale, values.shape[-1])


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(8, 4, 64, 16), (9, 3, 64, 32), (4, 2, 128, 16), (4, 4, 32, 16), (8, 1, 128, 8), (6, 2, 16, 1), (2, 2, 8, 32)],
)
def test_gqa_matches_reference(num_heads, num_kv_heads, head_dim, block_size):
    # Contexts of one token, one token short of, on and past a block boundary, and a long one.
    seq_lens = [1, block_size - 1 or 1, block_size, block_size + 1, 7 * block_size + 3]
    meta = make_metadata(seq_lens, [1] * len(seq_lens), block_size, num_blocks=64)
    cache = gqa_cache(64, num_kv_heads, block_size, head_dim, torch.float32)
    q = torch.randn(len(seq_lens), num_heads, head_dim)
    expected = decode_attention(q, cache, meta, 0.3, gather_gqa)
    assert_close(_gqa(meta, q, cache, 0.3), expected, f"seq_lens {seq_lens}")


@pytest.mark.parametrize("head_dim", [8, 64])
def test_queries_are_read_in_place_from_a_wider_row(head_dim):
    # q as the engine has it: the first columns of the fused q/k/v projection's rows.
    seq_lens = [5, 40, 17]
    meta = make_metadata(seq_lens, [1] * 3, 16, num_blocks=16)
    cache = gqa_cache(16, 2, 16, head_dim, torch.float32)
    qkv = torch.randn(3, 8 * head_dim)
    q = qkv[:, : 6 * head_dim].view(3, 6, head_dim)
    assert not q.is_contiguous()
    assert torch.equal(_gqa(meta, q, cache, 0.3), _gqa(meta, q.contiguous(), cache, 0.3))


def test_mla_reads_latents_as_keys_and_their_head_as_values():
    seq_lens = [1, 16, 33, 70]
    meta = make_metadata(seq_lens, [1] * len(seq_lens), 16, num_blocks=16)
    cache = mla_cache(16, 16, 96, torch.float32)
    q = torch.randn(len(seq_lens), 4, 96)
    latents = cache[:, None]
    out = paged_decode(q, latents, latents, meta.block_tables, meta.seq_lens, meta.max_seq_len, 0.1, 64)
    assert out.shape == (4, 4, 64)
    assert_close(out, decode_attention(q, cache, meta, 0.1, mla_gather(64)))


# Head sizes 64 and 128 take the 16-token vector path; 8 the generic loop.
@pytest.mark.parametrize("head_dim", [8, 64])
def test_large_scores_do_not_overflow(head_dim):
    # Scores in the thousands: only a max-subtracted softmax stays finite.
    meta = make_metadata([40], [1], 16, num_blocks=4)
    cache = gqa_cache(4, 1, 16, head_dim, torch.float32) * 30
    q = torch.randn(1, 1, head_dim) * 30
    assert_close(_gqa(meta, q, cache, 1.0), decode_attention(q, cache, meta, 1.0, gather_gqa))


@pytest.mark.parametrize("head_dim", [8, 64])
def test_rows_past_the_context_are_never_read(head_dim):
    # A block's unwritten rows may hold anything: NaN there must not reach the output.
    meta = make_metadata([21, 5], [1, 1], 16, num_blocks=8)
    cache = gqa_cache(8, 2, 16, head_dim, torch.float32)
    poisoned = cache.clone()
    for seq, seq_len in enumerate((21, 5)):
        last = meta.block_tables[seq, (seq_len - 1) // 16]
        cache[last, :, :, seq_len % 16 :] = 0.0
        poisoned[last, :, :, seq_len % 16 :] = float("nan")
    q = torch.randn(2, 4, head_dim)
    out = _gqa(meta, q, poisoned, 0.2)
    assert not out.isnan().any()
    assert_close(out, decode_attention(q, cache, meta, 0.2, gather_gqa))


@pytest.mark.parametrize("head_dim", [8, 64])
def test_a_block_id_outside_the_cache_is_an_error_not_a_read(head_dim):
    meta = make_metadata([20], [1], 16, num_blocks=4)
    meta.block_tables[0, 1] = 4
    cache = gqa_cache(4, 2, 16, head_dim, torch.float32)
    with pytest.raises(RuntimeError, match="block table entry is outside the cache"):
        _gqa(meta, torch.randn(1, 2, head_dim), cache, 1.0)


def test_bad_inputs_name_the_problem():
    meta = make_metadata([20], [1], 16, num_blocks=4)
    cache = gqa_cache(4, 2, 16, 8, torch.float32)
    keys, values = cache[:, 0], cache[:, 1]
    with pytest.raises(ValueError, match="float32 only"):
        paged_decode(torch.randn(1, 2, 8).bfloat16(), keys, values, meta.block_tables, meta.seq_lens, 20, 1.0, 8)
    with pytest.raises(ValueError, match="exceeds the block table"):
        paged_decode(torch.randn(1, 2, 8), keys, values, meta.block_tables, meta.seq_lens, 33, 1.0, 8)
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode(torch.randn(1, 3, 8), keys, values, meta.block_tables, meta.seq_lens, 20, 1.0, 8)


def _prefill(meta, q, cache, scale):
    return paged_prefill(
        q, cache[:, 0], cache[:, 1], meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_seq_len, scale
    )


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 1, 64, 16), (4, 4, 128, 32), (6, 2, 128, 16)],
)
def test_prompts_match_reference(num_heads, num_kv_heads, head_dim, block_size):
    # Whole prompts of one token, a block and past a tile of 64; a chunk and a prefix-cache hit
    # (queries that start mid-context); a decode-like single query.
    seq_lens = [1, block_size, 70, 150, 40, 33]
    query_lens = [1, block_size, 70, 150, 7, 1]
    meta = make_metadata(seq_lens, query_lens, block_size, num_blocks=64)
    cache = gqa_cache(64, num_kv_heads, block_size, head_dim, torch.float32)
    q = torch.randn(sum(query_lens), num_heads, head_dim)
    expected = TorchBackend().paged_attention(q, cache, meta, 0.11)
    assert_close(_prefill(meta, q, cache, 0.11), expected, f"seq_lens {seq_lens} query_lens {query_lens}")


def test_prompt_queries_are_read_in_place_from_a_wider_row():
    seq_lens, query_lens = [70, 33], [70, 9]
    meta = make_metadata(seq_lens, query_lens, 16, num_blocks=16)
    cache = gqa_cache(16, 3, 16, 64, torch.float32)
    qkv = torch.randn(79, 15 * 64)
    q = qkv[:, : 9 * 64].view(79, 9, 64)
    assert not q.is_contiguous()
    assert torch.equal(_prefill(meta, q, cache, 0.2), _prefill(meta, q.contiguous(), cache, 0.2))


def test_prompt_rows_past_the_context_are_never_read():
    meta = make_metadata([21, 37], [21, 5], 16, num_blocks=8)
    cache = gqa_cache(8, 2, 16, 64, torch.float32)
    poisoned = cache.clone()
    for seq, seq_len in enumerate((21, 37)):
        last = meta.block_tables[seq, (seq_len - 1) // 16]
        cache[last, :, :, seq_len % 16 :] = 0.0
        poisoned[last, :, :, seq_len % 16 :] = float("nan")
    q = torch.randn(26, 4, 64)
    out = _prefill(meta, q, poisoned, 0.2)
    assert not out.isnan().any()
    assert_close(out, TorchBackend().paged_attention(q, cache, meta, 0.2))


def test_prompt_large_scores_do_not_overflow():
    meta = make_metadata([90], [90], 16, num_blocks=8)
    cache = gqa_cache(8, 1, 16, 64, torch.float32) * 30
    q = torch.randn(90, 2, 64) * 30
    assert_close(_prefill(meta, q, cache, 1.0), TorchBackend().paged_attention(q, cache, meta, 1.0))


def test_prompt_kernel_errors_name_the_problem():
    meta = make_metadata([20], [20], 16, num_blocks=4)
    cache = gqa_cache(4, 2, 16, 64, torch.float32)
    meta.block_tables[0, 1] = 4
    with pytest.raises(RuntimeError, match="block table entry is outside the cache"):
        _prefill(meta, torch.randn(20, 2, 64), cache, 1.0)
    meta = make_metadata([20], [20], 16, num_blocks=4)
    with pytest.raises(RuntimeError, match="head sizes 64 and 128"):
        _prefill(meta, torch.randn(20, 2, 32), gqa_cache(4, 2, 16, 32, torch.float32), 1.0)
    with pytest.raises(ValueError, match="does not cover the 19 query rows"):
        _prefill(meta, torch.randn(19, 2, 64), cache, 1.0)
