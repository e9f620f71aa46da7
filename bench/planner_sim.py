"""The SLO planner against an averages-based rule and a static allocation, in the simulator.

Each standard trace (``steady``, ``diurnal``, ``step``, ``burst``, ``length_shift``,
``long_mix``; Poisson arrivals, lognormal lengths) is replayed, for each seed, through the
simulated cluster (``sim.simulator``) whose prefill and decode times come from an engine
profile measured on pdserve's own engine, three times:

- planner: ``pdserve.planner.planner.Planner`` with its default config.
- dynamo: a Dynamo-style planner, re-implemented from the algorithm NVIDIA Dynamo's SLA
  planner documents (``sim.dynamo_baseline``): profiled throughput per replica, a constant
  load forecast, replicas = ceil(load / capacity) per pool. Not Dynamo's code.
- static: the smallest fixed allocation that meets the SLO in at least ``--target`` of the
  scored intervals over the whole trace, peak included, found by search (each pool on its
  own latency: TTFT depends on the prefill pool, ITL on the decode pool).

All three run the same deployment: the same engine settings (``Knobs``, with the decode
batch capped where a step at the base traffic's context would miss the ITL target, as an
operator would set it), and both dynamic policies start from the static allocation (the
deployment as it was sized before they took over); only the planner retunes the knobs.
The first ``--warmup-s`` seconds are not scored. An interval meets the SLO when the true
TTFT p90 and ITL p90 of that interval (ITL: a request's mean gap between tokens), requests
not yet done included, are both within target.

The SLO targets and the load are derived from the profile so that any profile gives a
comparable scenario: TTFT p90 target = 4 x the prefill time of a p90 prompt; ITL p90 target
= 1.25 x a decode step of 16 median requests; the base rate is 1.5 prefill replicas' worth
of median traffic (peaks are 3x that).

    python -m bench.planner_sim --seeds 0,1,2       # a table, every trace x seed
    python -m bench.planner_sim --json              # one JSON object
    python -m bench.planner_sim --plot bench/plots/planner_sim.png
    python -m bench.planner_sim --measure-profile bench/profiles/cpu-tiny-llama.json
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec

from bench.lib.checkpoints import SHAPES, write_checkpoint
from bench.lib.report import emit
from pdserve.discovery.knobs import Knobs
from pdserve.discovery.slo import SLOTargets
from pdserve.planner.config import PlannerConfig
from pdserve.planner.latency_model import LatencyModel, LengthDistribution
from pdserve.planner.planner import Planner
from pdserve.planner.profile import EngineProfile
from sim.dynamo_baseline import DynamoBaseline
from sim.simulator import SimResult, simulate
from sim.traces import Trace, standard_traces

REPO = Path(__file__).resolve().parents[1]

DEFAULT_PROFILE = Path(__file__).resolve().parent / "profiles" / "cpu-tiny-llama.json"
PROMPT_MEDIAN, OUTPUT_MEDIAN = 256, 96  # tokens, of the base traffic
MAX_REPLICAS = 32  # per pool: room above the peak, so the bounds never decide the outcome


# -- the scenario ------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    slo: SLOTargets
    knobs: Knobs  # the deployment's settings, the same under every policy
    base_rate: float  # requests/s
    duration_s: float
    interval_s: int
    warmup_intervals: int
    target: float  # attainment the static allocation must reach

    def traces(self) -> list[Trace]:
        return standard_traces(self.base_rate, PROMPT_MEDIAN, OUTPUT_MEDIAN, self.duration_s)


def make_scenario(profile: EngineProfile, args: argparse.Namespace) -> Scenario:
    prompts = LengthDistribution(PROMPT_MEDIAN, PROMPT_MEDIAN * math.exp(0.6 * 1.2816))  # the traces' spread
    mean_prefill_s = sum(map(profile.prefill_seconds, prompts.quantiles())) / len(prompts.quantiles())
    context = PROMPT_MEDIAN + OUTPUT_MEDIAN
    slo = SLOTargets(
        model="sim",
        ttft_p90_s=round(4 * profile.prefill_seconds(prompts.p90), 3),
        itl_p90_s=round(1.25 * profile.decode_step_seconds(16, 16 * context), 4),
        max_prefill_replicas=MAX_REPLICAS,
        max_decode_replicas=MAX_REPLICAS,
    )
    # The deployment caps the decode batch where a step at the base traffic's context would
    # exceed the ITL target (with the planner's 0.85 margin): any operator would, and without
    # it a decode worker on this profile collapses into slow 64-sequence steps under load.
    mean_context = PROMPT_MEDIAN * math.exp(0.6**2 / 2) + OUTPUT_MEDIAN * math.exp(0.5**2 / 2) / 2
    cap = LatencyModel(profile).largest_batch_within(0.85 * slo.itl_p90_s, mean_context)
    return Scenario(
        slo=slo,
        # Every prompt starts in the prefill pool (threshold 0), as in the runs RESULTS.md records;
        # the planner turns local prefill on where it pays.
        knobs=Knobs(decode_max_num_seqs=min(cap, Knobs().decode_max_num_seqs), local_prefill_threshold_tokens=0),
        base_rate=round(1.5 / mean_prefill_s, 2),
        duration_s=args.duration_s,
        interval_s=args.interval_s,
        warmup_intervals=math.ceil(args.warmup_s / args.interval_s),
        target=args.target,
    )


# -- runs ---------------------------------------------------------------------------------


def _meets(record, slo: SLOTargets, metric: str) -> bool:
    value, target = (record.ttft_p90_s, slo.ttft_p90_s) if metric == "ttft" else (record.itl_p90_s, slo.itl_p90_s)
    return value is None or value <= target


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _median(values: list[float | None]) -> float | None:
    present = sorted(v for v in values if v is not None)
    return present[len(present) // 2] if present else None


def static_allocation(profile: EngineProfile, trace: Trace, sc: Scenario, seed: int) -> tuple[int, int, SimResult]:
    """The fewest replicas per pool whose fixed allocation meets its own latency target in
    ``sc.target`` of the scored intervals; binary search, each pool judged on its metric."""
    runs: dict[int, SimResult] = {}

    def run(n: int) -> SimResult:
        if n not in runs:
            runs[n] = simulate(
                profile, trace, sc.slo, None, prefill=n, decode=n, knobs=sc.knobs, interval_s=sc.interval_s, seed=seed
            )
        return runs[n]

    def fraction(n: int, metric: str) -> float:
        scored = run(n).intervals[sc.warmup_intervals :]
        return sum(_meets(r, sc.slo, metric) for r in scored) / len(scored)

    sizes = []
    for metric in ("ttft", "itl"):
        low, high = 1, MAX_REPLICAS
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if fraction(mid, metric) >= sc.target else (mid + 1, high)
        sizes.append(low)
    prefill, decode = sizes
    result = simulate(
        profile,
        trace,
        sc.slo,
        None,
        prefill=prefill,
        decode=decode,
        knobs=sc.knobs,
        interval_s=sc.interval_s,
        seed=seed,
    )
    return prefill, decode, result


def run_trace(profile: EngineProfile, trace: Trace, sc: Scenario, seed: int) -> dict[str, Any]:
    prefill, decode, static = static_allocation(profile, trace, sc, seed)
    knobs = sc.knobs
    planner = Planner(
        sc.slo,
        profile,
        PlannerConfig(interval_s=sc.interval_s),
        prefill_replicas=prefill,
        decode_replicas=decode,
        knobs=knobs,
    )
    baseline = DynamoBaseline(sc.slo, profile, knobs, sc.interval_s)
    baseline.prefill, baseline.decode = prefill, decode
    common = dict(prefill=prefill, decode=decode, knobs=knobs, interval_s=sc.interval_s, seed=seed)
    results = {
        "planner": simulate(profile, trace, sc.slo, planner, **common),
        "dynamo": simulate(profile, trace, sc.slo, baseline, **common),
        "static": static,
    }
    w = sc.warmup_intervals
    report: dict[str, Any] = {"trace": trace.name, "seed": seed, "static_prefill": prefill, "static_decode": decode}
    for name, result in results.items():
        scored = result.intervals[w:]
        report[name] = {
            "slo_attainment": round(result.attainment(w), 4),
            "met_intervals": sum(r.slo_met for r in scored),
            "scored_intervals": len(scored),
            "gpu_intervals": round(result.gpu_intervals(w), 1),
            "ttft_met": round(sum(_meets(r, sc.slo, "ttft") for r in scored) / len(scored), 4),
            "itl_met": round(sum(_meets(r, sc.slo, "itl") for r in scored) / len(scored), 4),
            "decisions": len(result.decisions),
            "max_prefill": max(r.prefill_gpus for r in scored),
            "max_decode": max(r.decode_gpus for r in scored),
            # Not scored (the SLO is TTFT and ITL): what a request takes from end to end.
            "e2e_p90_s_median": _median([r.e2e_p90_s for r in scored]),
            "e2e_p90_s_max": max((r.e2e_p90_s or 0.0) for r in scored),
        }
    settings = [knobs] + [d.knobs for d in results["planner"].decisions]
    report["planner_knob_changes"] = sum(a != b for a, b in zip(settings, settings[1:]))
    report["series"] = {name: [asdict(r) for r in result.intervals] for name, result in results.items()}
    return report


def summarise(profile: EngineProfile, profile_path: Path, sc: Scenario, runs: dict[str, dict]) -> dict[str, Any]:
    """Totals over every run (trace x seed) and each run's own figures; ``runs`` is keyed
    ``trace/seed``."""

    def total(policy: str, key: str, name: str | None = None) -> float:
        return sum(t[policy][key] for t in runs.values() if name is None or t["trace"] == name)

    def figures(name: str | None = None) -> dict[str, float]:
        scored = total("planner", "scored_intervals", name)
        static_gpu = total("static", "gpu_intervals", name)
        return {
            "slo_attainment": round(total("planner", "met_intervals", name) / scored, 4),
            "dynamo_slo_attainment": round(total("dynamo", "met_intervals", name) / scored, 4),
            "static_slo_attainment": round(total("static", "met_intervals", name) / scored, 4),
            "gpu_intervals_vs_static": round(total("planner", "gpu_intervals", name) / static_gpu, 4),
            "dynamo_gpu_intervals_vs_static": round(total("dynamo", "gpu_intervals", name) / static_gpu, 4),
        }

    names = list(dict.fromkeys(t["trace"] for t in runs.values()))
    return {
        **figures(),
        "min_run_slo_attainment": min(t["planner"]["slo_attainment"] for t in runs.values()),
        "per_trace": {name: figures(name) for name in names},
        "runs": {key: {k: v for k, v in t.items() if k != "series"} for key, t in runs.items()},
        "knobs": msgspec.to_builtins(sc.knobs),
        "slo": {
            "ttft_p90_s": sc.slo.ttft_p90_s,
            "itl_p90_s": sc.slo.itl_p90_s,
            "max_prefill_replicas": sc.slo.max_prefill_replicas,
            "max_decode_replicas": sc.slo.max_decode_replicas,
        },
        "scenario": {
            "base_rate": sc.base_rate,
            "peak_rate": 3 * sc.base_rate,
            "prompt_median": PROMPT_MEDIAN,
            "output_median": OUTPUT_MEDIAN,
            "duration_s": sc.duration_s,
            "interval_s": sc.interval_s,
            "warmup_intervals": sc.warmup_intervals,
            "static_target": sc.target,
        },
        "profile": {"path": _shown(profile_path), "name": profile.name, "source": profile.source},
    }


# -- output -------------------------------------------------------------------------------


def print_table(report: dict[str, Any]) -> None:
    print(f"profile: {report['profile']['name']}")
    slo = report["slo"]
    print(
        f"SLO: TTFT p90 {slo['ttft_p90_s'] * 1000:.0f} ms, ITL p90 {slo['itl_p90_s'] * 1000:.1f} ms; "
        f"base {report['scenario']['base_rate']} req/s, peaks 3x"
    )
    print(
        f"{'trace':<13} {'seed':>4} {'static P+D':>10} {'static att':>10} {'planner att':>11} {'dynamo att':>10} "
        f"{'planner GPU':>11} {'dynamo GPU':>10}"
    )
    for t in report["runs"].values():
        static_gpu = t["static"]["gpu_intervals"]
        print(
            f"{t['trace']:<13} {t['seed']:>4} {t['static_prefill']:>4}+{t['static_decode']:<5} "
            f"{t['static']['slo_attainment']:>10.3f} {t['planner']['slo_attainment']:>11.3f} "
            f"{t['dynamo']['slo_attainment']:>10.3f} {t['planner']['gpu_intervals'] / static_gpu:>10.2f}x "
            f"{t['dynamo']['gpu_intervals'] / static_gpu:>9.2f}x"
        )
    for name, f in [*report["per_trace"].items(), ("all", report)]:
        print(
            f"{name:<13} {'all':>4} {'':>10} {f['static_slo_attainment']:>10.3f} {f['slo_attainment']:>11.3f} "
            f"{f['dynamo_slo_attainment']:>10.3f} {f['gpu_intervals_vs_static']:>10.2f}x "
            f"{f['dynamo_gpu_intervals_vs_static']:>9.2f}x"
        )


def plot(path: Path, sc: Scenario, traces: dict[str, dict]) -> None:
    """Per trace: load; replicas of each policy; p90 TTFT and ITL over their targets."""
    try:
        import matplotlib
    except ImportError:
        print("--plot needs matplotlib: pip install 'pdserve[bench]'", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"planner": "tab:blue", "dynamo": "tab:orange", "static": "tab:gray"}
    fig, axes = plt.subplots(4, len(traces), figsize=(5 * len(traces), 11), sharex="col", squeeze=False)
    for col, (name, t) in enumerate(traces.items()):
        series = t["series"]
        minutes = [r["time"] / 60 for r in series["planner"]]
        load, replicas, ttft, itl = axes[:, col]
        load.plot(minutes, [r["arrival_rate"] for r in series["planner"]], color="black", lw=0.8)
        load.set_title(name)
        for policy, color in styles.items():
            rows = series[policy]
            replicas.plot(minutes, [r["prefill_gpus"] for r in rows], color=color, lw=1, label=f"{policy} prefill")
            replicas.plot(
                minutes, [r["decode_gpus"] for r in rows], color=color, lw=1, ls="--", label=f"{policy} decode"
            )
            for ax, key, target in ((ttft, "ttft_p90_s", sc.slo.ttft_p90_s), (itl, "itl_p90_s", sc.slo.itl_p90_s)):
                values = [min((r[key] or 0) / target, 4.0) for r in rows]  # clipped: a stalled pool is off the chart
                ax.plot(minutes, values, color=color, lw=0.8, label=policy)
        for ax in (ttft, itl):
            ax.axhline(1.0, color="red", lw=0.8, ls=":")
        load.set_ylabel("arrivals (req/s)")
        replicas.set_ylabel("replicas (GPUs held)")
        ttft.set_ylabel("TTFT p90 / target")
        itl.set_ylabel("ITL p90 / target")
        itl.set_xlabel("minutes")
    axes[1, 0].legend(fontsize=7, ncol=2)
    axes[2, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def measure_profile(out: Path) -> None:
    """Profile bench.lib.checkpoints' ``tiny`` Llama (random weights) on this machine."""
    from pdserve.engine.engine import LLMEngine
    from pdserve.planner.profiler import ProfilePlan, profile_engine
    from pdserve.types.engine_config import EngineConfig

    plan = ProfilePlan(
        prompt_lengths=(32, 128, 256, 512, 1024, 1536),
        batch_sizes=(1, 4, 8, 16, 32, 64),
        context_lengths=(128, 256, 512, 1024),
        repeats=3,
    )
    with tempfile.TemporaryDirectory(prefix="pdserve-profile-") as tmp:
        write_checkpoint(SHAPES["tiny"], Path(tmp), "float32", 0, None)
        engine = LLMEngine(tmp, EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048))
        source = f"python -m bench.planner_sim --measure-profile {out} (bench/offline.py shape 'tiny', random weights)"
        profile = profile_engine(engine, plan, source=source)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    print(f"wrote {out}: {profile.name}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.planner_sim",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", type=Path, help="write load, replicas and p90 latencies over time to this PNG")
    parser.add_argument(
        "--profile", type=Path, default=DEFAULT_PROFILE, help=f"engine profile (default: {DEFAULT_PROFILE.name})"
    )
    parser.add_argument(
        "--measure-profile", type=Path, metavar="OUT", help="measure the tiny model here, write OUT, exit"
    )
    parser.add_argument("--duration-s", type=float, default=1800.0, help="trace length (default: 1800)")
    parser.add_argument("--interval-s", type=int, default=10, help="planner interval (default: 10)")
    parser.add_argument("--warmup-s", type=float, default=120.0, help="unscored start (default: 120)")
    parser.add_argument("--target", type=float, default=0.95, help="attainment the static allocation must reach")
    parser.add_argument(
        "--traces", default="steady,diurnal,step,burst,length_shift,long_mix", help="comma-separated subset"
    )
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, each trace replayed with each")
    args = parser.parse_args(argv)
    if args.measure_profile:
        measure_profile(args.measure_profile)
        return
    started = time.perf_counter()
    profile = EngineProfile.load(args.profile)
    sc = make_scenario(profile, args)
    wanted = args.traces.split(",")
    seeds = [int(seed) for seed in args.seeds.split(",")]
    runs = {
        f"{t.name}/{seed}": run_trace(profile, t, sc, seed) for t in sc.traces() if t.name in wanted for seed in seeds
    }
    report = summarise(profile, args.profile, sc, runs)
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    if args.plot:
        plot(args.plot, sc, {key: t for key, t in runs.items() if t["seed"] == seeds[0]})
    emit(report, args.json, print_table)


if __name__ == "__main__":
    main()
