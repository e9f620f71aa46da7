"""Writing K/V and MLA latents into paged slots, against the reference's in-place writes."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.kv_write import write_kv, write_latent
from pdserve.kernels.torch_backend import TorchBackend
from tests.kernels.helpers import DTYPES, gqa_cache, make_metadata, mla_cache

# Sequences ending exactly on and just past a 16-token block, a 1-token context, a decode.
SEQ_LENS = [1, 16, 17, 40, 33]
QUERY_LENS = [1, 16, 17, 7, 1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96])
def test_write_kv_matches_reference(dtype, head_dim):
    meta = make_metadata(SEQ_LENS, QUERY_LENS, block_size=16, num_blocks=12)
    num_tokens = len(meta.slot_mapping)
    cache = gqa_cache(12, 3, 16, head_dim, dtype)
    k = torch.randn(num_tokens, 3, head_dim).to(dtype)
    v = torch.randn(num_tokens, 3, head_dim).to(dtype)
    got, want = cache.clone(), cache.clone()
    write_kv(got, k, v, meta.slot_mapping)
    TorchBackend().write_kv(want, k, v, meta.slot_mapping)
    assert torch.equal(got, want)


def test_write_kv_into_a_layer_view_leaves_other_layers_alone():
    full = torch.randn(6, 3, 2, 2, 8, 64)  # [blocks, layers, 2, Hkv, block_size, D]
    before = full.clone()
    slots = torch.tensor([0, 7, 8, 47])
    k, v = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    write_kv(full[:, 1], k, v, slots)
    assert torch.equal(full[:, 0], before[:, 0]) and torch.equal(full[:, 2], before[:, 2])
    assert torch.equal(full[5, 1, 0, :, 7], k[3])


def test_write_kv_of_no_tokens_is_a_no_op():
    cache = gqa_cache(2, 1, 16, 64, torch.float32)
    before = cache.clone()
    write_kv(cache, torch.empty(0, 1, 64), torch.empty(0, 1, 64), torch.empty(0, dtype=torch.int64))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("latent_dim", [576, 48])
def test_write_latent_matches_reference(dtype, latent_dim):
    meta = make_metadata(SEQ_LENS, QUERY_LENS, block_size=16, num_blocks=12)
    cache = mla_cache(12, 16, latent_dim, dtype)
    latent = torch.randn(len(meta.slot_mapping), latent_dim).to(dtype)
    got, want = cache.clone(), cache.clone()
    write_latent(got, latent, meta.slot_mapping)
    TorchBackend().write_latent(want, latent, meta.slot_mapping)
    assert torch.equal(got, want)
