"""``bench.kernels``: refuses cleanly without a GPU, and its code path runs (smoke mode)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run(
        [sys.executable, "-m", "bench.kernels", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_bench_without_a_gpu_exits_2_with_a_message():
    result = _run("--json")
    assert result.returncode == 2
    assert "needs a CUDA GPU" in result.stderr and result.stdout == ""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real benchmark (bench/gpu_check.sh)")
def test_bench_smoke_run_reports_every_kernel():
    result = _run("--smoke", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    kernels = {r["kernel"] for r in report["results"]}
    assert {
        "paged_attention_decode",
        "mla_attention_decode",
        "moe_expert_mlp",
        "rms_norm_residual",
        "write_latent",
        "block_fp8_gemm_decode",
        "block_fp8_gemm_prefill",
    } <= kernels
    assert all(r["median_ms"] > 0 for r in report["results"])
