"""Where a batch-1 decode step's time goes: the device's kernels, or the host launching them.

    python -m bench.decode_profile [--shape llama-3.1-8b] [--num-layers 8] [--dtype bfloat16] [--json]

Writes a random checkpoint of ``--shape`` (``--num-layers`` of its layers), runs one request of
``--prompt-tokens`` with ``--tokens`` new tokens through ``LLM.generate`` after a warm-up, then
the same again under ``torch.profiler``. It reports the wall time per generated token, the
device time its kernels took (the sum of their durations, from the profiler's device events),
how many kernels ran per token, and their ratio: a step whose device time is a small part of its
wall time is bound by the host (Python, launches), which CUDA graphs or fused kernels cure, not
faster kernels. On CPU (``--device cpu``, the tiny default there) it reports the wall time only:
a check of this script.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.lib.checkpoints import SHAPES, write_checkpoint
from bench.lib.machine import describe
from bench.lib.report import emit


def device_kernels(profile: torch.profiler.profile) -> tuple[float, int]:
    """The device time (ms) and count of the kernels the profile saw: the events on the device
    (each a kernel or a copy), by their own duration."""
    total_us, count = 0.0, 0
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total_us += getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0)
            count += 1
    return total_us / 1000, count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default=None, help="default: llama-3.1-8b on a GPU, tiny on CPU")
    parser.add_argument("--num-layers", type=int, default=8, help="layers of the shape (default: 8)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on CPU")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens timed (default: 64)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    shape = args.shape or ("llama-3.1-8b" if on_gpu else "tiny")
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    from pdserve import LLM, SamplingParams

    with tempfile.TemporaryDirectory(
        prefix="pdserve-profile-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
    ) as tmp:
        write_checkpoint(SHAPES[shape], Path(tmp), dtype, 0, args.num_layers)
        llm = LLM(
            tmp, dtype=dtype, max_num_seqs=1, max_model_len=args.prompt_tokens + args.tokens + 8, kv_cache_memory=2**28
        )
        prompt = [list(range(5, 5 + args.prompt_tokens))]
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        llm.generate(prompt, params)  # warm-up: compiles, allocations
        started = time.perf_counter()
        llm.generate(prompt, params)
        wall_ms = (time.perf_counter() - started) * 1000
        report: dict[str, Any] = {
            "shape": shape,
            "num_layers": args.num_layers,
            "dtype": dtype,
            "backend": llm.engine.backend.name,
            "tokens": args.tokens,
            "wall_ms_per_token": round(wall_ms / args.tokens, 3),
        }
        if on_gpu:
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as profile:
                started = time.perf_counter()
                llm.generate(prompt, params)
                torch.cuda.synchronize()
                profiled_ms = (time.perf_counter() - started) * 1000
            device_ms, kernels = device_kernels(profile)
            report |= {
                "profiled_wall_ms_per_token": round(profiled_ms / args.tokens, 3),
                "device_ms_per_token": round(device_ms / args.tokens, 3),
                "kernels_per_token": round(kernels / args.tokens, 1),
                "device_busy_fraction": round(device_ms / profiled_ms, 3),
            }
        llm.close()
    report["machine"] = describe()
    emit(report, args.json, lambda r: print("\n".join(f"{k}: {v}" for k, v in r.items() if k != "machine")))


if __name__ == "__main__":
    main()
