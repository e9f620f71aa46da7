"""CPU linear layers: the panel GEMM (``kernels/cpu/panel_gemm.c``) against oneDNN's GEMM on
its repacked weights, on a decode step's linears at several row counts.

    python bench/cpu_linear.py --json

A run is every linear of ``--layers`` layers of SmolLM2-135M's shape (q/k/v merged, o,
gate/up merged, down; each layer its own weights, so that they come from memory as in a
real step) and its LM head, once per system in turn (A B A B ...), ``--reps`` times; the
first two of each are dropped. Prints one JSON object: per row count, each system's median
milliseconds and GFLOPS, and the ratio oneDNN / panels (above 1: panels faster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.kernels.cpu import panel_gemm  # noqa: E402

# SmolLM2-135M: hidden 576, 9 heads and 3 KV heads of 64, intermediate 1536, vocabulary 49152.
LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)
LM_HEAD = (576, 49152)


def measure(rows: int, layers: int, reps: int, generator: torch.Generator) -> dict:
    shapes = LAYER_SHAPES * layers + [LM_HEAD]
    weights = [torch.randn(n_out, n_in, generator=generator) / n_in**0.5 for n_in, n_out in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    panels = [panel_gemm.pack(w) for w in weights]
    inputs = {n_in: torch.randn(rows, n_in, generator=generator) for n_in, _ in shapes}
    for (n_in, _), weight, packed in zip(shapes, weights, panels):  # same results first
        expected = torch.nn.functional.linear(inputs[n_in], weight)
        torch.testing.assert_close(panel_gemm.linear(inputs[n_in], packed), expected, rtol=1e-4, atol=1e-4)

    def run_onednn() -> None:
        for (n_in, _), w in zip(shapes, onednn):
            torch.ops.mkldnn._linear_pointwise(inputs[n_in], w, None, "none", [], "")

    def run_panels() -> None:
        for (n_in, _), w in zip(shapes, panels):
            panel_gemm.linear(inputs[n_in], w)

    times: dict[str, list[float]] = {"onednn": [], "panels": []}
    for _ in range(reps + 2):
        for name, run in (("onednn", run_onednn), ("panels", run_panels)):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    flop = 2 * rows * sum(n_in * n_out for n_in, n_out in shapes)
    result: dict = {"rows": rows}
    for name, values in times.items():
        ms = statistics.median(values[2:]) * 1e3
        result[name] = {"ms": round(ms, 3), "gflops": round(flop / ms / 1e6, 1)}
    result["onednn_over_panels"] = round(result["onednn"]["ms"] / result["panels"]["ms"], 3)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,8,16,32,64,128,512,2048", help="row counts, comma-separated")
    parser.add_argument("--layers", type=int, default=30, help="layers of weights (default: SmolLM2's 30)")
    parser.add_argument("--reps", type=int, default=10, help="measured runs per system and row count")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: every CPU)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = parser.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows must be integers separated by commas, got {args.rows!r}")
    if any(r < 1 for r in rows) or args.layers < 1 or args.reps < 1:
        parser.error("--rows, --layers and --reps must be at least 1")
    if not panel_gemm.available():
        print("bench/cpu_linear.py needs AVX-512 (the panel GEMM's); nothing was measured", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    results = []
    for count in rows:
        results.append(measure(count, args.layers, args.reps, generator))
        if not args.json:
            print(results[-1], file=sys.stderr)
    report = {
        "bench": "cpu_linear", "layers": args.layers, "reps": args.reps, "threads": args.threads,
        "machine": {"cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count(), "torch": torch.__version__},
        "results": results,
    }  # fmt: skip
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
