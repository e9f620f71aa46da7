"""Every kernel compiles for a real GPU (sm_90, to a cubin with Triton's bundled ptxas), on CPU.

The interpreter is lenient where the compiler is not (types carried around loops, constexpr
arguments, dot shapes), so passing the interpreter tests says little about whether the GPU
build works. This compiles each kernel with the block sizes the wrappers use on a GPU,
without needing one. It runs in a subprocess because TRITON_INTERPRET is read when a kernel
is defined and the rest of this test session defines them interpreted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INT_PTRS = {
    "tables_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "starts_ptr": "*i32",
    "slot_ptr": "*i64",
    "ids_ptr": "*i64",
    "counts_ptr": "*i64",
    "offsets_ptr": "*i64",
    "index_ptr": "*i64",
    "pair_rows_ptr": "*i64",
    "pos_ptr": "*i64",
    "token_index_ptr": "*i64",
}
F32_PTRS = {
    "part_out_ptr",
    "part_lse_ptr",
    "weights_ptr",
    "logits_ptr",
    "bias_ptr",
    "sorted_weights_ptr",
    "acc_ptr",
    "cs_ptr",
}
FLOATS = {"scale_log2", "eps", "scaling"}


def _compile(kernel, constexprs: dict, dtype: str = "bf16", types: dict | None = None) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for p in kernel.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            signature[p.name] = INT_PTRS.get(p.name) or ("*fp32" if p.name in F32_PTRS else f"*{dtype}")
        else:
            signature[p.name] = "fp32" if p.name in FLOATS else "i32"
    signature.update(types or {})
    constants = {(kernel.arg_names.index(k),): v for k, v in constexprs.items()}
    triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants), target=GPUTarget("cuda", 90, 32))


def compile_all() -> None:
    from pdserve.kernels import (
        block_fp8_gemm,
        kv_write,
        mla_decode,
        mla_extend,
        moe_align,
        moe_combine,
        moe_gemm,
        moe_routing,
        paged_decode,
        paged_extend,
        rms_norm,
        rotary,
    )

    for ieee, dtype in ((False, "bf16"), (True, "fp32")):
        _compile(
            paged_decode._decode_split_kernel, dict(DIRECT=False, IEEE=ieee, BLOCK_H=16, BLOCK_N=64, BLOCK_D=128), dtype
        )
        _compile(paged_extend._extend_kernel, dict(IEEE=ieee, BLOCK_M=64, BLOCK_N=32, BLOCK_D=128), dtype)
    mla = dict(IEEE=False, HAS_ROPE=True, BLOCK_N=32, BLOCK_V=512, BLOCK_R=64)
    _compile(paged_decode._decode_split_kernel, dict(DIRECT=True, IEEE=False, BLOCK_H=16, BLOCK_N=64, BLOCK_D=128))
    _compile(paged_decode._merge_splits_kernel, dict(BLOCK_SPLITS=16, BLOCK_D=128))
    _compile(mla_decode._mla_decode_split_kernel, dict(DIRECT=False, BLOCK_H=16, **mla))
    _compile(mla_extend._mla_extend_kernel, dict(BLOCK_M=32, **mla))
    _compile(rms_norm._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=8192))
    _compile(rotary._rotary_kernel, dict(INTERLEAVED=True, BLOCK_H=32, BLOCK_HALF=64))
    _compile(kv_write._write_kv_kernel, dict(BLOCK_H=8, BLOCK_D=128))
    _compile(kv_write._write_latent_kernel, dict(BLOCK=1024))
    _compile(
        moe_routing._route_kernel,
        dict(
            SIGMOID=True,
            HAS_BIAS=True,
            GROUPED=True,
            TOP2_SUM=True,
            TOPK_GROUPS=4,
            TOP_K=8,
            RENORMALIZE=True,
            BLOCK_G=8,
            BLOCK_GS=32,
            BLOCK_K=8,
        ),
    )
    _compile(moe_align._count_kernel, dict(BLOCK=1024))
    _compile(moe_align._scatter_kernel, dict(BLOCK=1024, BLOCK_E=256))
    _compile(moe_align._gather_rows_kernel, dict(ROWS=4, BLOCK=1024))
    gemm = dict(IEEE=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, BLOCK_E=256)
    _compile(moe_gemm._gate_up_kernel, gemm)
    _compile(moe_gemm._down_kernel, gemm)
    _compile(moe_combine._combine_kernel, dict(BLOCK=1024))
    _compile(moe_combine._scatter_add_kernel, dict(BLOCK=1024))
    # DeepSeek-V3's 128x128 blocks: FP8 operands, float32 scales, bf16 bias and output.
    fp8 = {"xq_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "bias_ptr": "*bf16"}
    _compile(
        block_fp8_gemm._gemm_kernel, dict(HAS_BIAS=True, IEEE=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128), types=fp8
    )
    _compile(
        block_fp8_gemm._quantize_kernel,
        dict(BLOCK_K=128),
        types={"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "fp8_max": "fp32"},
    )


def _has_ptxas() -> bool:
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.slow
@pytest.mark.skipif(not _has_ptxas(), reason="this triton build ships no ptxas")
def test_every_kernel_compiles_for_sm90(tmp_path):
    # A fresh cache: a hit in the shared one would skip the compile being tested.
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path))
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.test_compile_sm90"],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]


if __name__ == "__main__":
    compile_all()
