"""``CpuBackend`` as the engine sees it: whole mixed steps and linears against ``TorchBackend``,
and how the engine picks it."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.cpu import paged_decode
from pdserve.kernels.cpu.build import CpuKernelsUnavailable, load_library
from pdserve.kernels.cpu.cpu_backend import CpuBackend
from pdserve.kernels.cpu.panel_gemm import PanelWeight
from pdserve.kernels.select import select_backend
from pdserve.kernels.torch_backend import TorchBackend
from tests.kernels.helpers import assert_close, gqa_cache, make_metadata, mla_cache

# Decodes first (contexts 1, 16, 17, 50), then a prompt, a prefix-cache hit and a chunk.
SEQ_LENS = [1, 16, 17, 50, 20, 40, 33]
QUERY_LENS = [1, 1, 1, 1, 20, 6, 17]


def test_gqa_step_matches_reference():
    meta = make_metadata(SEQ_LENS, QUERY_LENS, block_size=16, num_blocks=16)
    q = torch.randn(sum(QUERY_LENS), 8, 64)
    cache = gqa_cache(16, 2, 16, 64, torch.float32)
    assert_close(
        CpuBackend().paged_attention(q, cache, meta, 0.125), TorchBackend().paged_attention(q, cache, meta, 0.125)
    )


def test_gqa_steps_with_prompts_of_every_kind_match_reference():
    # Prompts alone and behind decodes, chunks and prefix hits, head size 128, blocks of 32.
    backend, reference = CpuBackend(), TorchBackend()
    for seq_lens, query_lens in (([1, 70, 9, 33, 100], [1, 70, 9, 1, 37]), ([300, 5], [300, 5])):
        meta = make_metadata(seq_lens, query_lens, block_size=32, num_blocks=24)
        q = torch.randn(sum(query_lens), 6, 128)
        cache = gqa_cache(24, 3, 32, 128, torch.float32)
        expected = reference.paged_attention(q, cache, meta, 0.09)
        assert_close(backend.paged_attention(q, cache, meta, 0.09), expected, f"{seq_lens} {query_lens}")


def test_a_head_size_without_the_vector_path_matches_reference():
    meta = make_metadata(SEQ_LENS, QUERY_LENS, block_size=16, num_blocks=16)
    q = torch.randn(sum(QUERY_LENS), 4, 32)
    cache = gqa_cache(16, 2, 16, 32, torch.float32)
    assert_close(CpuBackend().paged_attention(q, cache, meta, 0.2), TorchBackend().paged_attention(q, cache, meta, 0.2))


def test_mla_step_matches_reference():
    meta = make_metadata(SEQ_LENS, QUERY_LENS, block_size=16, num_blocks=16)
    q = torch.randn(sum(QUERY_LENS), 4, 96)
    cache = mla_cache(16, 16, 96, torch.float32)
    expected = TorchBackend().mla_attention(q, cache, meta, 0.07, 64)
    assert_close(CpuBackend().mla_attention(q, cache, meta, 0.07, 64), expected)


def test_bfloat16_takes_the_reference_path():
    meta = make_metadata(SEQ_LENS, QUERY_LENS, block_size=16, num_blocks=16)
    q = torch.randn(sum(QUERY_LENS), 8, 64).bfloat16()
    cache = gqa_cache(16, 2, 16, 64, torch.bfloat16)
    out = CpuBackend().paged_attention(q, cache, meta, 0.125)
    assert torch.equal(out, TorchBackend().paged_attention(q, cache, meta, 0.125))


def _backend(weight_format: str) -> CpuBackend:
    backend = CpuBackend()
    if weight_format == "panels" and backend.weight_format != "panels":
        pytest.skip("this CPU has no AVX-512: the panel GEMM is not built for it")
    backend.weight_format = weight_format  # "onednn" is the fallback: every x86 CPU runs it
    return backend


@pytest.mark.parametrize("weight_format", ["panels", "onednn"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 32, 300])
def test_repacked_linear_matches_plain_linear(rows, bias, weight_format):
    backend = _backend(weight_format)
    weight, b = torch.randn(96, 40), (torch.randn(96) if bias else None)
    packed = backend.prepare_weight(weight)
    assert isinstance(packed, PanelWeight) if weight_format == "panels" else packed.is_mkldnn
    x = torch.randn(rows, 40)
    assert_close(backend.linear(x, packed, b), F.linear(x, weight, b))


@pytest.mark.parametrize("weight_format", ["panels", "onednn"])
def test_logits_are_float32_rows_by_vocabulary(weight_format):
    backend = _backend(weight_format)
    lm_head = torch.randn(1000, 32)
    hidden = torch.randn(3, 32)
    logits = backend.logits(hidden, backend.prepare_weight(lm_head))
    assert logits.shape == (3, 1000) and logits.dtype == torch.float32
    assert_close(logits, hidden @ lm_head.t())


def test_other_dtypes_keep_their_weights():
    backend = CpuBackend()
    weight = torch.randn(8, 4).bfloat16()
    assert backend.prepare_weight(weight) is weight
    x = torch.randn(2, 4).bfloat16()
    assert torch.equal(backend.linear(x, weight), F.linear(x, weight))


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    load_library.cache_clear()
    paged_decode._kernel.cache_clear()
    yield
    load_library.cache_clear()
    paged_decode._kernel.cache_clear()


def test_auto_picks_the_cpu_kernels_on_cpu():
    assert select_backend("auto", torch.device("cpu")).name == "cpu"
    assert select_backend("torch", torch.device("cpu")).name == "torch"


def test_without_a_compiler_auto_falls_back_to_the_reference_and_says_so(no_compiler, caplog):
    with caplog.at_level(logging.WARNING, logger="pdserve.engine"):
        assert select_backend("auto", torch.device("cpu")).name == "torch"
    assert "CPU kernels unavailable" in caplog.text and "no C compiler found" in caplog.text
    with pytest.raises(CpuKernelsUnavailable, match="no C compiler found"):
        select_backend("cpu", torch.device("cpu"))


def test_cpu_kernels_refuse_a_gpu_device():
    with pytest.raises(ValueError, match="kernels='cpu' runs on the CPU only"):
        select_backend("cpu", torch.device("cuda"))
