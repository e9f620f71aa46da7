"""Benchmark pdserve's Triton kernels against this GPU's measured roofline.

    python -m bench.kernels [--json] [--only SUBSTRING]

For each kernel at Llama-3.1-8B and DeepSeek-V3 shapes: the median time
(``triton.testing.do_bench``), the bytes it must move and the FLOPs it must do (the ideal
traffic, not what the kernel happens to read), the achieved GB/s and TFLOP/s, and both as a
fraction of ceilings measured here first: a large device-to-device copy (bandwidth) and a
large bf16 matmul (compute). Targets (issue 3): GQA and MLA decode >= 0.70 of bandwidth at
batch 64 x 4k context; fused MoE >= 0.50 of matmul throughput at 8k tokens. The block-scaled
FP8 GEMM (issue 13) runs at a decode batch (bandwidth-bound) and at 8k tokens (compute-bound).

The expert-parallel all-to-all (dispatch and combine between GPUs) needs several GPUs and
has its own script: ``torchrun --nproc-per-node 8 -m bench.all_to_all``.

Needs a CUDA GPU and exits with status 2 without one. ``--smoke`` runs tiny shapes on CPU in
Triton's interpreter with a wall-clock timer: only to check this script, its numbers mean
nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from bench.lib.report import emit, median


@dataclass(frozen=True)
class Case:
    kernel: str
    model: str
    shape: str
    run: Callable[[], object]
    bytes: float
    flops: float


@dataclass(frozen=True)
class Sizes:
    """The dimensions that the smoke run shrinks."""

    batch: int
    context: int
    prefill_seqs: int
    prefill_prefix: int
    prefill_new: int
    tokens: int
    moe_tokens: int
    llama_heads: int
    llama_kv_heads: int
    llama_hidden: int
    v3_heads: int
    v3_hidden: int
    v3_experts: int
    v3_inter: int
    v3_attn_out: int  # o_proj's input: heads x v_head_dim


FULL = Sizes(64, 4096, 4, 2048, 2048, 8192, 8192, 32, 8, 4096, 128, 7168, 256, 2048, 16384)
SMOKE = Sizes(2, 40, 2, 8, 9, 16, 16, 4, 2, 64, 4, 64, 16, 32, 96)


def _time_ms(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return median(samples)


def measure_ceilings(device: str, smoke: bool) -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write counted) and bf16 matmul throughput (TFLOP/s)."""
    numel = (1 << 20) if smoke else (1 << 30)  # 2 GiB of bf16 each way on a GPU
    src = torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_ms = _time_ms(lambda: dst.copy_(src), device)
    n = 256 if smoke else 8192
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    mm_ms = _time_ms(lambda: a @ b, device)
    return {"copy_gbps": 2 * numel * 2 / copy_ms / 1e6, "matmul_tflops": 2 * n**3 / mm_ms / 1e9}


def _metadata(seq_lens: list[int], query_lens: list[int], block_size: int, device: str):
    from pdserve.kernels.backend import AttentionMetadata

    blocks = [-(-s // block_size) for s in seq_lens]
    # Shuffled blocks, as a long-running pool's are.
    perm = torch.randperm(sum(blocks), device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    used = 0
    slots = []
    for i, (n, s, q) in enumerate(zip(blocks, seq_lens, query_lens)):
        tables[i, :n] = perm[used : used + n]
        pos = torch.arange(s - q, s, device=device)
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
        used += n
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens_list=seq_lens,
        query_lens_list=query_lens,
        num_decodes=num_decodes,
        block_size=block_size,
    )
    return meta, sum(blocks)


def _visible_keys(seq_lens: list[int], query_lens: list[int]) -> int:
    """Sum over all queries of the keys each one attends to (causal)."""
    return sum(q * (s - q) + q * (q + 1) // 2 for s, q in zip(seq_lens, query_lens))


def attention_cases(z: Sizes, device: str, backend) -> list[Case]:
    dt, e = torch.bfloat16, 2
    cases = []
    decode = ([z.context] * z.batch, [1] * z.batch)
    prefill = ([z.prefill_prefix + z.prefill_new] * z.prefill_seqs, [z.prefill_new] * z.prefill_seqs)
    # Llama-3.1-8B: 32 query heads over 8 KV heads of 128, 16-token blocks.
    hq, hkv, d = z.llama_heads, z.llama_kv_heads, 128
    for label, (seq_lens, query_lens) in (("decode", decode), ("extend", prefill)):
        meta, num_blocks = _metadata(seq_lens, query_lens, 16, device)
        cache = torch.randn(num_blocks, 2, hkv, 16, d, device=device).to(dt)
        q = torch.randn(sum(query_lens), hq, d, device=device).to(dt)
        keys = _visible_keys(seq_lens, query_lens)
        kv_bytes = sum(seq_lens) * 2 * hkv * d * e
        cases.append(
            Case(
                f"paged_attention_{label}",
                "Llama-3.1-8B",
                f"{len(seq_lens)} seqs x {seq_lens[0]} ctx, {query_lens[0]} new",
                lambda q=q, cache=cache, meta=meta: backend.paged_attention(q, cache, meta, d**-0.5),
                kv_bytes + 2 * q.numel() * e,
                4 * keys * hq * d,
            )
        )
    # DeepSeek-V3: 128 heads, absorbed MLA over 512 + 64 latents, 64-token blocks.
    h, lat, v = z.v3_heads, 576, 512
    for label, (seq_lens, query_lens) in (("decode", decode), ("extend", prefill)):
        meta, num_blocks = _metadata(seq_lens, query_lens, 64, device)
        cache = torch.randn(num_blocks, 64, lat, device=device).to(dt)
        q = torch.randn(sum(query_lens), h, lat, device=device).to(dt)
        keys = _visible_keys(seq_lens, query_lens)
        cases.append(
            Case(
                f"mla_attention_{label}",
                "DeepSeek-V3",
                f"{len(seq_lens)} seqs x {seq_lens[0]} ctx, {query_lens[0]} new",
                lambda q=q, cache=cache, meta=meta: backend.mla_attention(q, cache, meta, lat**-0.5, v),
                sum(seq_lens) * lat * e + q.numel() * e + q.shape[0] * h * v * e,
                2 * keys * h * (lat + v),
            )
        )
    return cases


def small_op_cases(z: Sizes, device: str, backend) -> list[Case]:
    dt, e, t = torch.bfloat16, 2, z.tokens
    cases = []
    for model, hidden in (("Llama-3.1-8B", z.llama_hidden), ("DeepSeek-V3", z.v3_hidden)):
        x, res = torch.randn(t, hidden, device=device).to(dt), torch.randn(t, hidden, device=device).to(dt)
        w = torch.ones(hidden, device=device, dtype=dt)
        cases.append(
            Case(
                "rms_norm_residual",
                model,
                f"{t} x {hidden}",
                lambda x=x, res=res, w=w: backend.rms_norm(x, w, 1e-6, res),
                4 * x.numel() * e,
                4 * x.numel(),
            )
        )
    cos_sin = torch.randn(z.context * 2, 128, device=device)
    positions = torch.randint(0, z.context * 2, (t,), device=device)
    q = torch.randn(t, z.llama_heads, 128, device=device).to(dt)
    cases.append(
        Case(
            "rotary_neox",
            "Llama-3.1-8B",
            f"{t} x {z.llama_heads} x 128",
            lambda: backend.rotary(q, positions, cos_sin, False),
            2 * q.numel() * e,
            3 * q.numel(),
        )
    )
    q_rope = torch.randn(t, z.v3_heads, 192, device=device).to(dt)[..., 128:]
    cs64 = cos_sin[:, :64].contiguous()
    cases.append(
        Case(
            "rotary_interleaved",
            "DeepSeek-V3",
            f"{t} x {z.v3_heads} x 64 (strided)",
            lambda: backend.rotary(q_rope, positions, cs64, True),
            2 * q_rope.numel() * e,
            3 * q_rope.numel(),
        )
    )
    blocks = -(-t // 16) + 1
    cache = torch.zeros(blocks, 2, z.llama_kv_heads, 16, 128, device=device, dtype=dt)
    k = torch.randn(t, z.llama_kv_heads, 128, device=device).to(dt)
    slots = torch.randperm(blocks * 16, device=device)[:t]
    cases.append(
        Case(
            "write_kv",
            "Llama-3.1-8B",
            f"{t} tokens",
            lambda: backend.write_kv(cache, k, k, slots),
            4 * k.numel() * e,
            0,
        )
    )
    lat_cache = torch.zeros(blocks, 16, 576, device=device, dtype=dt)
    latent = torch.randn(t, 576, device=device).to(dt)
    cases.append(
        Case(
            "write_latent",
            "DeepSeek-V3",
            f"{t} tokens",
            lambda: backend.write_latent(lat_cache, latent, slots),
            2 * latent.numel() * e,
            0,
        )
    )
    return cases


def moe_cases(z: Sizes, device: str, backend) -> list[Case]:
    from pdserve.kernels.backend import MoERouting

    dt, e, t, num_experts, hidden, inter = torch.bfloat16, 2, z.moe_tokens, z.v3_experts, z.v3_hidden, z.v3_inter
    config = MoERouting(
        top_k=8, scoring="sigmoid", num_groups=8, topk_groups=4, group_score="top2_sum", scaling_factor=2.5
    )
    logits = torch.randn(t, num_experts, device=device)
    bias = torch.randn(num_experts, device=device) / 10
    x = torch.randn(t, hidden, device=device).to(dt)
    weights, ids = backend.route(logits, config, bias)
    tokens = backend.dispatch(x, weights, ids, num_experts)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=dt) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device=device, dtype=dt) / inter**0.5
    expert_out = backend.expert_mlp(tokens, w13, w2)
    rows = t * config.top_k
    shape = f"{t} tokens, {num_experts} experts, top-8, {hidden}/{inter}"
    return [
        Case(
            "moe_route_grouped",
            "DeepSeek-V3",
            shape,
            lambda: backend.route(logits, config, bias),
            logits.numel() * 4 + rows * 12,
            0,
        ),
        Case(
            "moe_dispatch",
            "DeepSeek-V3",
            shape,
            lambda: backend.dispatch(x, weights, ids, num_experts),
            2 * rows * hidden * e,
            0,
        ),
        Case(
            "moe_expert_mlp",
            "DeepSeek-V3",
            shape,
            lambda: backend.expert_mlp(tokens, w13, w2),
            (w13.numel() + w2.numel()) * e + 2 * rows * hidden * e,
            6 * rows * hidden * inter,
        ),
        Case(
            "moe_combine",
            "DeepSeek-V3",
            shape,
            lambda: backend.combine(expert_out, tokens, t),
            (rows + t) * hidden * e,
            2 * rows * hidden,
        ),
    ]


def fp8_gemm_cases(z: Sizes, device: str, backend) -> list[Case]:
    """DeepSeek-V3's o_proj in its checkpoint's FP8 with 128 x 128 block scales, at a decode
    batch and a prefill chunk. The FLOP fraction is against the bf16 matmul ceiling: FP8
    tensor cores peak at twice that."""
    from pdserve.kernels.block_fp8 import BlockFP8Weight

    num_out, num_in, block = z.v3_hidden, z.v3_attn_out, (128, 128)
    weight = BlockFP8Weight(
        (torch.randn(num_out, num_in, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn),
        torch.rand(-(-num_out // 128), -(-num_in // 128), device=device) / 1e3,
        block,
    )
    cases = []
    for label, tokens in (("decode", z.batch), ("prefill", z.tokens)):
        x = torch.randn(tokens, num_in, device=device).to(torch.bfloat16)
        # The weight and its scales once, the activations in and quantized, the output out.
        moved = weight.weight.numel() + weight.scale_inv.numel() * 4 + x.numel() * (2 + 1) + tokens * num_out * 2
        cases.append(
            Case(
                f"block_fp8_gemm_{label}",
                "DeepSeek-V3",
                f"{tokens} x {num_in} -> {num_out}, 128x128 blocks",
                lambda x=x: backend.linear(x, weight),
                moved,
                2 * tokens * num_out * num_in,
            )
        )
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--only", default="", help="run only kernels whose name contains this")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter), to test this script")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(
            "bench/kernels.py needs a CUDA GPU and none is visible; nothing was measured. "
            "(The kernels' correctness tests run on CPU: pytest tests/kernels.)",
            file=sys.stderr,
        )
        return 2
    device = "cpu" if args.smoke else "cuda"
    from pdserve.kernels.triton_backend import TritonBackend  # after the device check: sets up triton

    backend = TritonBackend()
    sizes = SMOKE if args.smoke else FULL
    ceilings = measure_ceilings(device, args.smoke)
    results = []
    for build in (attention_cases, moe_cases, fp8_gemm_cases, small_op_cases):
        for case in build(sizes, device, backend):
            if args.only not in case.kernel:
                continue
            ms = _time_ms(case.run, device)
            gbps, tflops = case.bytes / ms / 1e6, case.flops / ms / 1e9
            results.append(
                {
                    "kernel": case.kernel,
                    "model": case.model,
                    "shape": case.shape,
                    "median_ms": ms,
                    "gbps": gbps,
                    "tflops": tflops,
                    "bandwidth_fraction": gbps / ceilings["copy_gbps"],
                    "compute_fraction": tflops / ceilings["matmul_tflops"],
                }
            )
        if device == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter smoke run)"
    report = {"device": name, "ceilings": ceilings, "results": results}
    emit(report, args.json, _print_table, indent=1)
    return 0


def _print_table(report: dict) -> None:
    ceilings, results = report["ceilings"], report["results"]
    print(
        f"{report['device']}: copy {ceilings['copy_gbps']:.0f} GB/s, bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s"
    )
    print(f"{'kernel':24} {'model':13} {'ms':>9} {'GB/s':>8} {'TFLOP/s':>8} {'%bw':>5} {'%mm':>5}  shape")
    for r in results:
        print(
            f"{r['kernel']:24} {r['model']:13} {r['median_ms']:9.4f} {r['gbps']:8.1f} {r['tflops']:8.2f} "
            f"{100 * r['bandwidth_fraction']:5.1f} {100 * r['compute_fraction']:5.1f}  {r['shape']}"
        )


if __name__ == "__main__":
    sys.exit(main())
