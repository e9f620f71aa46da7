"""``TritonBackend`` as the engine sees it: whole mixed steps against ``TorchBackend``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels.backend import Backend, MoERouting
from pdserve.kernels.torch_backend import TorchBackend
from pdserve.kernels.triton_backend import TritonBackend
from tests.kernels.helpers import DTYPES, assert_close, gqa_cache, make_metadata, mla_cache
from tests.kernels.test_moe_routing import distinct_logits

# Decodes first (contexts 1, 16, 17), then a prompt, a prefix-cache hit and a chunk.
SEQ_LENS = [1, 16, 17, 20, 40, 33]
QUERY_LENS = [1, 1, 1, 20, 6, 17]


def test_is_a_complete_backend():
    backend = TritonBackend()  # abstract methods left out would make this raise
    assert isinstance(backend, Backend) and backend.name == "triton"


@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_layer_step_matches_reference(dtype):
    meta = make_metadata(SEQ_LENS, QUERY_LENS, block_size=16, num_blocks=12)
    assert meta.num_decodes == 3
    num_tokens = sum(QUERY_LENS)
    q = torch.randn(num_tokens, 8, 64).to(dtype)
    k, v = torch.randn(num_tokens, 2, 64).to(dtype), torch.randn(num_tokens, 2, 64).to(dtype)
    caches = {}
    outs = {}
    start = gqa_cache(12, 2, 16, 64, dtype)
    for backend in (TorchBackend(), TritonBackend()):
        cache = start.clone()
        backend.write_kv(cache, k, v, meta.slot_mapping)
        caches[backend.name] = cache
        outs[backend.name] = backend.paged_attention(q, cache, meta, 0.125)
    assert torch.equal(caches["triton"], caches["torch"])
    assert_close(outs["triton"], outs["torch"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_layer_step_matches_reference(dtype):
    meta = make_metadata(SEQ_LENS, QUERY_LENS, block_size=16, num_blocks=12)
    num_tokens = sum(QUERY_LENS)
    q = torch.randn(num_tokens, 4, 576).to(dtype)
    latent = torch.randn(num_tokens, 576).to(dtype)
    start = mla_cache(12, 16, 576, dtype)
    outs = {}
    for backend in (TorchBackend(), TritonBackend()):
        cache = start.clone()
        backend.write_latent(cache, latent, meta.slot_mapping)
        outs[backend.name] = backend.mla_attention(q, cache, meta, 0.07, 512)
    assert outs["triton"].shape == (num_tokens, 4, 512)
    assert_close(outs["triton"], outs["torch"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_layer_matches_reference(dtype):
    num_tokens, num_experts, hidden, inter = 11, 16, 64, 48
    config = MoERouting(
        top_k=4, scoring="sigmoid", num_groups=4, topk_groups=2, group_score="top2_sum", scaling_factor=2.5
    )
    x = torch.randn(num_tokens, hidden).to(dtype)
    logits = distinct_logits(num_tokens, num_experts)  # float32, as DeepSeek's gate computes
    bias = torch.randn(num_experts) / 4
    w13 = (torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter) / inter**0.5).to(dtype)
    outs = {}
    for backend in (TorchBackend(), TritonBackend()):
        weights, ids = backend.route(logits, config, bias)
        tokens = backend.dispatch(x, weights, ids, num_experts)
        outs[backend.name] = backend.combine(backend.expert_mlp(tokens, w13, w2), tokens, num_tokens)
    assert_close(outs["triton"], outs["torch"])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback to the interpreter")
def test_loading_the_triton_backend_selects_the_interpreter_on_cpu():
    # A fresh interpreter with TRITON_INTERPRET unset: triton_backend must set it before
    # its kernels are defined, or launching them on CPU tensors fails.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import os, torch\n"
        "from pdserve.kernels.triton_backend import TritonBackend\n"
        "assert os.environ['TRITON_INTERPRET'] == '1'\n"
        "x = torch.randn(3, 64)\n"
        "out, _ = TritonBackend().rms_norm(x, torch.ones(64), 1e-6)\n"
        "torch.testing.assert_close(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only guard")
def test_a_kernel_imported_before_the_choice_on_cpu_refuses_to_load():
    # Its @triton.jit functions would be compiled for a GPU that is not there.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import pdserve.kernels.rms_norm\n"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0 and "use_interpreter_without_cuda()" in result.stderr
