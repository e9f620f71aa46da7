"""Online serving benchmark: a gRPC load generator for pdserve, and disaggregated against colocated.

Targets: ``--target HOST:PORT`` measures a server that is already running. ``--model PATH`` (or
``--random-model SHAPE``, a random-weight checkpoint of ``bench.lib.checkpoints``' shapes written
to a temporary directory) starts the deployment itself with ``LocalCluster``, the code behind
``pdserve up`` (frontend and workers as child processes, embedded etcd unless ``--etcd``).
With ``--compare`` one invocation runs two deployments one after the other, on the same
workers count and the same load (same requests, same arrival times):

  disaggregated: --prefill P prefill + --decode D decode workers, --disaggregation always;
  colocated:     0 prefill + P+D decode workers, --disaggregation off (a decode worker
                 computes a prompt itself when no KV source is given: P+D combined workers).

Every worker gets ``--threads-per-worker`` torch threads (default: the usable CPUs shared evenly).

Load: ``--rate R`` (open loop, Poisson arrivals, requests/s) or ``--concurrency C`` (closed
loop). Prompts are random token ids below the served vocabulary (``ListModels``); prompt and
output lengths are uniform over their ranges; ``--shared-prefix-fraction`` of the requests
start with one of ``--num-prefixes`` shared prefixes of ``--prefix-len`` tokens. Every request
has ``ignore_eos``, so it produces exactly its drawn output length; greedy unless
``--temperature``. ``--seed`` fixes the workload. Warm-up requests (distinct random prompts,
at most 8 tokens out) run before each measurement and are not counted.

Measured on the client (one grpc.aio channel, a stream per request, each with a deadline):
TTFT, ITL and E2E (see ``bench/lib/load.py`` for the exact rules: a message carrying n
tokens gives each of them 1/n of its gap), and from each final message the server's breakdown
(queue, prefill, KV transfer time and bytes, disaggregated or not). Throughput is over the
measured span, first send to last end. Goodput counts the requests per second that meet BOTH
``--ttft-slo`` and ``--itl-slo``, a request's ITL being its own p90 (``--itl-slo-stat mean``:
its mean ITL, i.e. TPOT).

KV transfer and TTFT: pdserve streams the first token from the prefill worker as soon as the
prompt is computed, before the decode worker pulls the KV. So KV transfer is not part of
TTFT; it delays the second token. The report gives kv_transfer_ms / ttft_ms (the transfer
measured against TTFT: what it would add if it sat on that path) and kv_transfer_ms over the
first ITL (the share of the gap it really sits in).

    python -m bench.serve --random-model tiny --compare --rate 1 --num-requests 64 --json
    python -m bench.serve --target 127.0.0.1:50051 --concurrency 8 --num-requests 200
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from bench.lib import machine
from bench.lib.checkpoints import SHAPES, write_checkpoint
from bench.lib.deploy import Deployment, DeploySpec
from bench.lib.load import SamplingSpec, WorkloadSpec, list_models, make_requests, poisson_arrivals, run_load
from bench.lib.report import emit
from bench.serve_report import plot_cdfs, print_table, ratios, summarise
from pdserve.cli.common import add_engine_args, duration, from_options
from pdserve.frontend.config import DISAGGREGATION_MODES
from pdserve.launch.local_cluster import ChildFailed
from pdserve.types.engine_config import EngineConfig


@dataclasses.dataclass(frozen=True)
class Plan:
    """One deployment to start: its worker counts and the frontend's disaggregation mode."""

    name: str
    num_prefill: int
    num_decode: int
    disaggregation: str

    @property
    def label(self) -> str:
        return f"{self.num_prefill}P+{self.num_decode}D, --disaggregation {self.disaggregation}"


def length_range(text: str) -> tuple[int, int]:
    try:
        low, _, high = text.partition(":")
        return int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH or N, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="a running pdserve frontend, HOST:PORT")
    where.add_argument("--model", help="a model directory: start the deployment(s) here with LocalCluster")
    where.add_argument(
        "--random-model",
        metavar="SHAPE",
        help="like --model, with random weights of bench.lib.checkpoints' SHAPE (e.g. tiny), written with transformers",
    )
    parser.add_argument(
        "--max-position-embeddings", type=int, default=None, help="--random-model: override the shape's context window"
    )
    parser.add_argument("--model-name", default="", help="--target: the served model (default: the only one)")
    parser.add_argument("--compare", action="store_true", help="run disaggregated, then colocated, at the same load")
    parser.add_argument(
        "--prefill", type=int, default=1, help="prefill workers of the (disaggregated) deployment (default: 1)"
    )
    parser.add_argument(
        "--decode", type=int, default=1, help="decode workers of the (disaggregated) deployment (default: 1)"
    )
    parser.add_argument(
        "--disaggregation",
        choices=DISAGGREGATION_MODES,
        default="always",
        help="frontend mode without --compare (default: always)",
    )
    parser.add_argument("--etcd", default=None, help="etcd URL (default: an embedded registry per deployment)")
    parser.add_argument(
        "--threads-per-worker",
        type=int,
        default=None,
        help="torch threads of each worker (default: usable CPUs // workers, at least 1)",
    )
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="open loop: Poisson arrivals, requests/s")
    load.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    parser.add_argument("--num-requests", type=int, default=64, help="measured requests (default: 64)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up requests (default: 2 per worker)")
    parser.add_argument(
        "--prompt-len", type=length_range, default=(64, 512), help="prompt tokens, LOW:HIGH (default: 64:512)"
    )
    parser.add_argument(
        "--output-len", type=length_range, default=(16, 128), help="output tokens, LOW:HIGH (default: 16:128)"
    )
    parser.add_argument(
        "--shared-prefix-fraction",
        type=float,
        default=0.0,
        help="share of requests starting with a shared prefix (default: 0)",
    )
    parser.add_argument("--prefix-len", type=int, default=256, help="tokens of each shared prefix (default: 256)")
    parser.add_argument("--num-prefixes", type=int, default=4, help="how many shared prefixes (default: 4)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    parser.add_argument(
        "--seed", type=int, default=0, help="workload, arrivals, sampling and random weights (default: 0)"
    )
    parser.add_argument(
        "--request-timeout", type=duration, default=300.0, help="deadline of every request (default: 300s)"
    )
    parser.add_argument("--ttft-slo", type=duration, default=0.5, help="goodput's TTFT bound (default: 500ms)")
    parser.add_argument("--itl-slo", type=duration, default=0.05, help="goodput's ITL bound (default: 50ms)")
    parser.add_argument(
        "--itl-slo-stat",
        choices=["p90", "mean"],
        default="p90",
        help="which of a request's ITLs the bound applies to (default: p90)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--plot", type=Path, default=None, help="write CDFs of TTFT and ITL to this PNG (needs matplotlib)"
    )
    add_engine_args(parser)
    return parser


def _log(message: str) -> None:
    print(f"[serve] {message}", file=sys.stderr, flush=True)


def write_random_model(
    shape_name: str, directory: Path, seed: int, max_position_embeddings: int | None
) -> dict[str, Any]:
    if shape_name not in SHAPES:
        raise SystemExit(f"--random-model: unknown shape {shape_name!r}; shapes: {', '.join(SHAPES)}")
    shape = SHAPES[shape_name]
    if max_position_embeddings is not None:
        shape = dataclasses.replace(shape, config=shape.config | {"max_position_embeddings": max_position_embeddings})
    info = write_checkpoint(shape, directory, "float32", seed, None)
    return {
        "shape": shape_name,
        "description": shape.description,
        "max_position_embeddings": shape.config["max_position_embeddings"],
        "dtype": "float32",
        **info,
    }


class Bench:
    """Runs the load against each target, on one workload built from the first target's vocabulary."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.sampling = SamplingSpec(args.temperature, args.seed, args.request_timeout)
        self.workload: tuple[list, list, list[float] | None] | None = None
        self.model_info: dict[str, Any] | None = None

    def spec(self, num_workers: int) -> WorkloadSpec:
        a = self.args
        return WorkloadSpec(
            num_requests=a.num_requests,
            num_warmup=2 * num_workers if a.warmup is None else a.warmup,
            prompt_len=a.prompt_len,
            output_len=a.output_len,
            shared_prefix_fraction=a.shared_prefix_fraction,
            prefix_len=a.prefix_len,
            num_prefixes=a.num_prefixes,
            seed=a.seed,
        )

    async def measure(self, target: str, model: dict[str, Any], num_workers: int) -> dict[str, Any]:
        a = self.args
        spec = self.spec(num_workers)
        if self.workload is None:
            if spec.longest_prompt + spec.output_len[1] > model["max_model_len"]:
                raise SystemExit(
                    f"the longest request ({spec.longest_prompt} + {spec.output_len[1]} tokens) does not fit "
                    f"the served context window ({model['max_model_len']})"
                )
            warmup, requests = make_requests(spec, model["vocab_size"])
            arrivals = poisson_arrivals(len(requests), a.rate, a.seed) if a.rate else None
            self.workload, self.model_info = (warmup, requests, arrivals), model
        warmup, requests, arrivals = self.workload
        _log(f"{len(warmup)} warm-up, then {len(requests)} measured requests against {target}")
        load_before = os.getloadavg()
        results, duration, warm_errors = await run_load(
            target,
            model["name"],
            warmup,
            requests,
            self.sampling,
            arrivals=arrivals,
            concurrency=a.concurrency,
            warmup_concurrency=num_workers,
        )
        summary = summarise(
            results,
            duration,
            requests,
            ttft_slo_ms=a.ttft_slo * 1e3,
            itl_slo_ms=a.itl_slo * 1e3,
            itl_stat=a.itl_slo_stat,
        )
        summary["warmup_errors"] = dict(warm_errors)
        summary["load_average_1m"] = {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)}
        summary["_samples"] = {
            "ttft_ms": [r.ttft_ms for r in results if r.ttft_ms is not None],
            "itl_ms": [x for r in results if r.error is None for x in r.itls_ms],
        }
        return summary

    async def run_target(self) -> dict[str, dict[str, Any]]:
        models = await list_models(self.args.target)
        if not models:
            raise SystemExit(f"{self.args.target} serves no model")
        name = self.args.model_name
        chosen = [m for m in models if m["name"] == name] if name else models
        if len(chosen) != 1:
            raise SystemExit(f"pick one model with --model-name; served: {[m['name'] for m in models]}")
        model = chosen[0]
        return {
            "target": await self.measure(self.args.target, model, model["prefill_workers"] + model["decode_workers"])
        }

    async def run_plan(self, plan: Plan, model_path: str, threads: int) -> dict[str, Any]:
        a = self.args
        name = f"bench-{plan.name}"
        engine = from_options(a, EngineConfig)
        spec = DeploySpec(
            plan.num_prefill,
            plan.num_decode,
            plan.disaggregation,
            model=model_path,
            model_name=name,
            threads_per_worker=threads,
            etcd=a.etcd,
            http=True,
            engine=engine,
            request_timeout_s=a.request_timeout,
            start_timeout_s=360,
        )
        deployment = {
            "workers": plan.label,
            "num_prefill": plan.num_prefill,
            "num_decode": plan.num_decode,
            "disaggregation": plan.disaggregation,
            "threads_per_worker": threads,
            "engine": msgspec.to_builtins(engine),
        }
        started = time.perf_counter()
        _log(f"starting {plan.name}: {plan.label}, {threads} thread(s) per worker")
        try:
            async with Deployment(spec) as running:
                deployment["start_s"] = round(time.perf_counter() - started, 1)
                result = await self.measure(running.address, running.model, plan.num_prefill + plan.num_decode)
                if plan.num_prefill:
                    result["handoff_ms"] = await _handoff_breakdown(running.etcd_url, name)
        except (ChildFailed, RuntimeError, TimeoutError) as exc:
            _log(f"{plan.name} failed: {exc}")
            return {"deployment": deployment, "error": str(exc)}
        return {"deployment": deployment, **result}


async def _handoff_breakdown(etcd_url: str, model_name: str) -> dict[str, float | int]:
    """The decode workers' mean hand-off phases (their Prometheus histograms, every request of
    the run, warm-up included): admit (queued in the engine until given blocks), pull (the KV
    read), resume (KV landed -> the next token: the wait for a step, and the step)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from pdserve.discovery.etcd import close_quietly, connect
    from pdserve.discovery.registry import Role, list_workers

    client = await connect(etcd_url)
    try:
        workers = [w for w in await list_workers(client) if w.role is Role.DECODE and w.model == model_name]
    finally:
        await close_quietly(client)
    phases = {
        "admit": "pdserve_queue_seconds",
        "pull": "pdserve_kv_transfer_seconds",
        "resume": "pdserve_kv_resume_seconds",
    }
    sums = {f"{n}_{k}": 0.0 for n in phases.values() for k in ("sum", "count")}
    for worker in workers:
        if worker.metrics_port is None:
            continue
        host = worker.endpoint.rsplit(":", 1)[0]
        url = f"http://{host}:{worker.metrics_port}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in sums:
                    sums[sample.name] += sample.value
    out: dict[str, float | int] = {"num_requests": int(sums["pdserve_kv_transfer_seconds_count"])}
    for phase, metric in phases.items():
        count = sums[f"{metric}_count"]
        out[f"{phase}_mean"] = round(sums[f"{metric}_sum"] / count * 1e3, 2) if count else 0.0
    return out


async def _main(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    bench = Bench(args)
    try:
        if args.target:
            return await bench.run_target()
        model_path = args.model or report["checkpoint_dir"]
        if args.compare:
            workers = args.prefill + args.decode
            plans = [Plan("disaggregated", args.prefill, args.decode, "always"), Plan("colocated", 0, workers, "off")]
        else:
            colocated = args.prefill == 0 or args.disaggregation == "off"
            name = "colocated" if colocated else "disaggregated" if args.disaggregation == "always" else "conditional"
            plans = [Plan(name, args.prefill, args.decode, args.disaggregation)]
        workers = max(p.num_prefill + p.num_decode for p in plans)
        threads = args.threads_per_worker or max(1, len(os.sched_getaffinity(0)) // workers)
        report["threads_per_worker"] = threads
        return {plan.name: await bench.run_plan(plan, model_path, threads) for plan in plans}
    finally:
        report["served_model"] = bench.model_info


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.prefill < 0 or args.decode < 1:
        raise SystemExit("need --prefill >= 0 and --decode >= 1")
    if args.prefill == 0 and (args.compare or args.disaggregation == "always"):
        raise SystemExit("--compare and --disaggregation always need --prefill >= 1")
    if (args.rate is not None and args.rate <= 0) or (args.concurrency is not None and args.concurrency < 1):
        raise SystemExit("need --rate > 0 or --concurrency >= 1")
    try:
        spec = Bench(args).spec(1)  # checks the workload's values
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    report: dict[str, Any] = {
        "bench": "serve",
        "target": args.target,
        "model": args.model,
        "load": {
            "mode": "poisson" if args.rate else "closed_loop",
            "rate": args.rate,
            "concurrency": args.concurrency,
            "num_requests": args.num_requests,
            "prompt_len": list(spec.prompt_len),
            "output_len": list(spec.output_len),
            "shared_prefix_fraction": spec.shared_prefix_fraction,
            "prefix_len": spec.prefix_len,
            "num_prefixes": spec.num_prefixes,
            "temperature": args.temperature,
            "ignore_eos": True,
            "seed": args.seed,
        },
        "slo": {"ttft_ms": args.ttft_slo * 1e3, "itl_ms": args.itl_slo * 1e3, "itl_stat": args.itl_slo_stat},
        "definitions": {
            "itl": "gap between token-carrying messages, split evenly among the message's tokens; "
            "the first message's extra tokens are not counted",
            "goodput": "requests/s meeting ttft <= ttft_slo and (request's itl_stat of its ITLs) <= itl_slo",
            "kv_transfer_share_of_ttft": "kv_transfer_ms / client ttft_ms over disaggregated requests; the first token "
            "is streamed before the KV pull, so this is a size comparison, not a part of TTFT",
            "kv_transfer_share_of_first_itl": "kv_transfer_ms / gap from the first to the second token message",
            "ratios": "disaggregated / colocated",
        },
    }
    with tempfile.TemporaryDirectory(prefix="pdserve-serve-bench-") as tmp:
        if args.random_model:
            report["checkpoint_dir"] = str(Path(tmp) / "checkpoint")
            _log(f"writing a random {args.random_model} checkpoint to {report['checkpoint_dir']}")
            report["random_model"] = write_random_model(
                args.random_model, Path(report["checkpoint_dir"]), args.seed, args.max_position_embeddings
            )
        runs = asyncio.run(_main(args, report))
    report.pop("checkpoint_dir", None)
    samples = {name: run.pop("_samples", None) for name, run in runs.items()}
    report["runs"] = runs
    if "disaggregated" in runs and "colocated" in runs and "error" not in runs["disaggregated"] | runs["colocated"]:
        report["ratios"] = ratios(runs["disaggregated"], runs["colocated"])
    report["machine"] = machine.describe() | {"threads_per_worker": report.get("threads_per_worker")}
    if args.plot is not None:
        report["plot"] = plot_cdfs(args.plot, {k: v for k, v in samples.items() if v}, report)
    return report


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    emit(run(args), args.json, print_table)


if __name__ == "__main__":
    main()
