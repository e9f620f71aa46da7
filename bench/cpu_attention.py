"""CPU attention kernels (``kernels/cpu/paged_decode.c``) in the engine's cache layout, on
SmolLM2-135M's attention shape (9 query heads, 3 KV heads of 64, blocks of 16 tokens).

    python -m bench.cpu_attention --json [--against OLD/paged_decode.c]

- ``decode``: one decode step's attention, 32 sequences of 64-319 cached tokens, every one of
  ``--layers`` layers in turn, so that the cache comes from memory as in a real step. Also
  one layer repeated (``hot``), its cache in the CPU's caches.
- ``prompt``: a 2,048-token prompt step (prompts of 64-256 tokens), every layer in turn.

Blocks are scattered over a 2 GiB cache, as a running engine's are. With ``--against`` (a
version of the C file whose exported functions take the same arguments, with
``vector_math.h`` beside it or taken from this tree) both builds run alternately (A B B A
...), ``--reps`` times each, and the outputs must agree within 1e-5. Prints each build's
median milliseconds per layer, the decode GB/s (the cache bytes read), the prompt GFLOPS
(causal: only the keys each query sees) and the ratio against / current (above 1: current
faster).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.lib import machine
from bench.lib.kernel_copy import build_copy
from bench.lib.report import emit, median, ratio
from pdserve.kernels.cpu import paged_decode
from pdserve.kernels.cpu.build import load_library
from pdserve.model.kv_cache import KVCache, KVCacheSpec

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5


@dataclass
class Batch:
    """Sequences over the cache: their lengths, block tables and queries."""

    lens: torch.Tensor  # [S] int32
    tables: torch.Tensor  # [S, max blocks] int32
    q: torch.Tensor  # [rows, HEADS, HEAD_DIM]
    query_start: torch.Tensor  # [S + 1] int32


def build(lengths: list[int], query_lens: list[int], free: list[int], generator: torch.Generator) -> Batch:
    blocks = [(n + BLOCK - 1) // BLOCK for n in lengths]
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    for s, count in enumerate(blocks):
        tables[s, :count] = torch.tensor([free.pop() for _ in range(count)], dtype=torch.int32)
    starts = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    q = torch.randn(int(starts[-1]), HEADS, HEAD_DIM, generator=generator)
    return Batch(torch.tensor(lengths, dtype=torch.int32), tables, q, starts)


def kernels(library: ctypes.CDLL) -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:
    """The decode and prompt functions of a build of ``paged_decode.c``."""
    decode, prompt = library.pdserve_paged_decode, library.pdserve_paged_prefill
    for function, like in ((decode, paged_decode._kernel()), (prompt, paged_decode._prefill_kernel())):
        function.restype, function.argtypes = like.restype, like.argtypes
    return decode, prompt


def run(function, cache: KVCache, layers: list[int], batch: Batch, prompt: bool) -> torch.Tensor:
    """``function`` (the decode kernel, or the prompt kernel when ``prompt``) on each layer in turn."""
    out = torch.empty(batch.q.shape)
    threads = torch.get_num_threads()
    for layer in layers:
        view = cache.layer(layer)
        keys, values = view[:, 0], view[:, 1]
        cache_args = (
            batch.q.data_ptr(),
            batch.q.stride(0),
            keys.data_ptr(),
            values.data_ptr(),
            keys.shape[0],
            keys.stride(0),
            keys.stride(1),
            keys.stride(2),
            batch.tables.data_ptr(),
            batch.tables.stride(0),
            batch.lens.data_ptr(),
        )
        num_seqs = batch.lens.shape[0]
        if prompt:
            status = function(
                *cache_args,
                batch.query_start.data_ptr(),
                num_seqs,
                HEADS,
                KV_HEADS,
                BLOCK,
                HEAD_DIM,
                int(batch.lens.max()),
                SCALE,
                out.data_ptr(),
                threads,
            )
        else:
            status = function(
                *cache_args, num_seqs, HEADS, KV_HEADS, BLOCK, HEAD_DIM, HEAD_DIM, SCALE, out.data_ptr(), threads
            )
        assert status == 0, status
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", type=Path, help="another version of paged_decode.c to run alternately")
    parser.add_argument("--layers", type=int, default=30, help="layers of cache (default: SmolLM2's 30)")
    parser.add_argument("--reps", type=int, default=5, help="measured runs per build and case (default 5)")
    parser.add_argument("--cache-gib", type=float, default=2.0, help="cache size the blocks are spread over")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: every CPU)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = parser.parse_args(argv)
    if args.against is not None and not args.against.is_file():
        parser.error(f"--against {args.against}: no such file")
    torch.set_num_threads(args.threads)

    spec = KVCacheSpec(
        num_layers=args.layers,
        block_size=BLOCK,
        dtype=torch.float32,
        is_mla=False,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
    )
    num_blocks = int(args.cache_gib * 2**30) // spec.bytes_per_block
    cache = KVCache(spec, num_blocks, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    cache.data.normal_(generator=generator)
    rng = random.Random(0)
    free = list(range(num_blocks))
    rng.shuffle(free)
    decode_lens = [rng.randint(64, 256) + rng.randint(0, 63) for _ in range(32)]
    prompt_lens: list[int] = []
    while sum(prompt_lens) < 2048:
        prompt_lens.append(min(rng.randint(64, 256), 2048 - sum(prompt_lens)))
    needed = sum((n + BLOCK - 1) // BLOCK for n in decode_lens + prompt_lens)
    if needed > num_blocks:
        parser.error(f"--cache-gib {args.cache_gib} holds {num_blocks} blocks; the batches need {needed}")
    decode_batch = build(decode_lens, [1] * 32, free, generator)
    prompt_batch = build(prompt_lens, prompt_lens, free, generator)

    current = Path(paged_decode.__file__).with_suffix(".c")
    builds = {"current": kernels(load_library(current))}
    with tempfile.TemporaryDirectory() as directory:
        if args.against is not None:
            builds["against"] = kernels(build_copy(args.against, current, Path(directory)))
        layers = list(range(args.layers))
        cases = {
            "decode": lambda fns: run(fns[0], cache, layers, decode_batch, prompt=False),
            "decode_hot": lambda fns: run(fns[0], cache, [0] * args.layers, decode_batch, prompt=False),
            "prompt": lambda fns: run(fns[1], cache, layers, prompt_batch, prompt=True),
        }
        for name, case in cases.items():  # same results first
            outputs = [case(fns) for fns in builds.values()]
            for other in outputs[1:]:
                torch.testing.assert_close(other, outputs[0], rtol=1e-5, atol=1e-5, msg=f"{name}: the builds disagree")
        times: dict[str, dict[str, list[float]]] = {name: {b: [] for b in builds} for name in cases}
        for rep in range(args.reps):
            for name, case in cases.items():
                order = list(builds.items())  # A B, then B A: whichever runs first in a pair is not favoured
                for build_name, fns in order if rep % 2 == 0 else order[::-1]:
                    start = time.perf_counter()
                    case(fns)
                    times[name][build_name].append((time.perf_counter() - start) / args.layers * 1e3)

    decode_bytes = int(decode_batch.lens.sum()) * KV_HEADS * HEAD_DIM * 4 * 2
    prompt_flops = sum(n * (n + 1) / 2 for n in prompt_lens) * HEADS * HEAD_DIM * 4
    result: dict = {
        "shape": f"{HEADS} heads / {KV_HEADS} KV heads of {HEAD_DIM}, blocks of {BLOCK}, {args.layers} layers",
        "decode_batch": {"sequences": 32, "cached_tokens": int(decode_batch.lens.sum())},
        "prompt_batch": {"prompts": len(prompt_lens), "tokens": sum(prompt_lens)},
        "threads": args.threads,
        "reps": args.reps,
        "machine": machine.describe(),
    }
    for name in cases:
        entry = {}
        for build_name in builds:
            ms = median(times[name][build_name])
            rate = (
                {"gb_s": round(decode_bytes / ms / 1e6, 1)}
                if name.startswith("decode")
                else {"gflops": round(prompt_flops / ms / 1e6, 1)}
            )
            entry[build_name] = {"ms_per_layer": round(ms, 4), **rate}
        if "against" in builds:
            entry["against_over_current"] = ratio(entry["against"]["ms_per_layer"], entry["current"]["ms_per_layer"])
        result[name] = entry

    def table(report: dict) -> None:
        for name in cases:
            print(name, report[name])

    emit(result, args.json, table, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
