"""CPU linear layers: the panel GEMM (``kernels/cpu/panel_gemm.c``) against oneDNN's GEMM on
its repacked weights, on a decode step's linears at several row counts.

    python -m bench.cpu_linear --json [--against OLD/panel_gemm.c]

A run is every linear of ``--layers`` layers of SmolLM2-135M's shape (q/k/v merged, o,
gate/up merged, down; each layer its own weights, so that they come from memory as in a
real step) and its LM head, once per system in turn, ``--reps`` times, the order reversed
every other time (A B C, C B A, ...); the first two of each are dropped. With ``--against``
(another version of panel_gemm.c with this one's C signature) its build runs as a third
system. Prints one JSON object: per row count, each system's median milliseconds and
GFLOPS, the ratio oneDNN / panels (above 1: panels faster) and, with ``--against``, the
ratio against / panels (above 1: this tree's faster).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.lib import machine
from bench.lib.kernel_copy import build_copy
from bench.lib.report import emit, median
from pdserve.kernels.cpu import panel_gemm

Linear = Callable[[torch.Tensor, panel_gemm.PanelWeight], torch.Tensor]

# SmolLM2-135M: hidden 576, 9 heads and 3 KV heads of 64, intermediate 1536, vocabulary 49152.
LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)
LM_HEAD = (576, 49152)


def linear_of(library: ctypes.CDLL) -> Linear:
    """``panel_gemm.linear`` through another build of panel_gemm.c."""
    gemm = library.pdserve_panel_gemm
    like = panel_gemm._library().pdserve_panel_gemm
    gemm.restype, gemm.argtypes = like.restype, like.argtypes

    def linear(x: torch.Tensor, weight: panel_gemm.PanelWeight) -> torch.Tensor:
        out = torch.empty(x.shape[0], weight.out_features)
        gemm(
            x.data_ptr(),
            x.shape[0],
            x.shape[1],
            x.stride(0),
            weight.panels.data_ptr(),
            weight.out_features,
            None,
            out.data_ptr(),
            torch.get_num_threads(),
            weight.gated,
        )
        return out

    return linear


def measure(rows: int, layers: int, reps: int, generator: torch.Generator, against: Linear | None) -> dict:
    shapes = LAYER_SHAPES * layers + [LM_HEAD]
    weights = [torch.randn(n_out, n_in, generator=generator) / n_in**0.5 for n_in, n_out in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    panels = [panel_gemm.pack(w) for w in weights]
    inputs = {n_in: torch.randn(rows, n_in, generator=generator) for n_in, _ in shapes}
    for (n_in, _), weight, packed in zip(shapes, weights, panels):  # same results first
        expected = torch.nn.functional.linear(inputs[n_in], weight)
        ours = panel_gemm.linear(inputs[n_in], packed)
        torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
        if against is not None:
            torch.testing.assert_close(against(inputs[n_in], packed), ours, rtol=1e-5, atol=1e-5)

    def run_onednn() -> None:
        for (n_in, _), w in zip(shapes, onednn):
            torch.ops.mkldnn._linear_pointwise(inputs[n_in], w, None, "none", [], "")

    def runner(linear: Linear) -> Callable[[], None]:
        def run() -> None:
            for (n_in, _), w in zip(shapes, panels):
                linear(inputs[n_in], w)

        return run

    systems = {"onednn": run_onednn, "panels": runner(panel_gemm.linear)}
    if against is not None:
        systems["against"] = runner(against)
    times: dict[str, list[float]] = {name: [] for name in systems}
    for rep in range(reps + 2):
        order = list(systems.items())
        for name, run in order if rep % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    flop = 2 * rows * sum(n_in * n_out for n_in, n_out in shapes)
    result: dict = {"rows": rows}
    for name, values in times.items():
        ms = median(values[2:]) * 1e3
        result[name] = {"ms": round(ms, 3), "gflops": round(flop / ms / 1e6, 1)}
    result["onednn_over_panels"] = round(result["onednn"]["ms"] / result["panels"]["ms"], 3)
    if against is not None:
        result["against_over_panels"] = round(result["against"]["ms"] / result["panels"]["ms"], 3)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, help="another version of panel_gemm.c to run alternately")
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
    if args.against is not None and not args.against.is_file():
        parser.error(f"--against {args.against}: no such file")
    if not panel_gemm.available():
        print("bench/cpu_linear.py needs AVX-512 (the panel GEMM's); nothing was measured", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory() as directory:
        against = None
        if args.against is not None:
            current = Path(panel_gemm.__file__).with_suffix(".c")
            against = linear_of(build_copy(args.against, current, Path(directory)))
        for count in rows:
            results.append(measure(count, args.layers, args.reps, generator, against))
            if not args.json:
                print(results[-1], file=sys.stderr)
    report = {
        "bench": "cpu_linear",
        "layers": args.layers,
        "reps": args.reps,
        "threads": args.threads,
        "machine": machine.describe(),
        "results": results,
    }
    if args.json:
        emit(report, True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
