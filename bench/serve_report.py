"""The statistics and the report of ``bench.serve``: percentiles, goodput, ratios, table, plot.

Percentiles interpolate linearly between samples (as numpy's default). Goodput counts the
requests that meet both SLOs: TTFT <= the TTFT bound and the request's own ITL statistic (its
p90, or its mean, i.e. TPOT) <= the ITL bound; a request with a single output token has no ITL
and is judged by TTFT alone.
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from bench.lib.load import BenchRequest, RequestResult
from bench.lib.report import percentiles, ratio


def request_itl(result: RequestResult, stat: str) -> float | None:
    """The ITL a request is judged by for goodput: its own p90 or mean ITL (None: one token only)."""
    if not result.itls_ms:
        return None
    if stat == "mean":
        return statistics.fmean(result.itls_ms)
    return percentiles(result.itls_ms)["p90"]  # type: ignore[index]


def summarise(
    results: list[RequestResult],
    duration_s: float,
    requests: list[BenchRequest],
    *,
    ttft_slo_ms: float,
    itl_slo_ms: float,
    itl_stat: str,
) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    by_index = {q.index: q for q in requests}
    prompt_tokens = sum(len(by_index[r.index].prompt) for r in ok)
    output_tokens = sum(r.num_tokens for r in ok)

    def meets(r: RequestResult) -> bool:
        itl = request_itl(r, itl_stat)
        return r.ttft_ms is not None and r.ttft_ms <= ttft_slo_ms and (itl is None or itl <= itl_slo_ms)

    good = sum(meets(r) for r in ok)
    disaggregated = [r for r in ok if r.breakdown.get("disaggregated")]
    share_ttft = [r.breakdown["kv_transfer_ms"] / r.ttft_ms for r in disaggregated if r.ttft_ms]
    share_gap = [r.breakdown["kv_transfer_ms"] / r.first_gap_ms for r in disaggregated if r.first_gap_ms]
    kv_bytes = sum(r.breakdown["kv_transfer_bytes"] for r in disaggregated)
    kv_ms = sum(r.breakdown["kv_transfer_ms"] for r in disaggregated)
    server = {key: percentiles([r.breakdown[key] for r in ok]) for key in ("queue_ms", "prefill_ms", "ttft_ms")}
    server["kv_transfer_ms"] = percentiles([r.breakdown["kv_transfer_ms"] for r in disaggregated])
    per_s = (lambda n: round(n / duration_s, 3)) if duration_s > 0 else (lambda n: 0.0)
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "errors": dict(Counter(r.error for r in results if r.error)),
        "short_outputs": sum(r.num_tokens != by_index[r.index].max_tokens for r in ok),
        "duration_s": round(duration_s, 3),
        "request_throughput": per_s(len(ok)),
        "output_token_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(output_tokens + prompt_tokens),
        "goodput": per_s(good),
        "goodput_fraction": round(good / len(results), 3),
        "ttft_ms": percentiles([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "itl_ms": percentiles([x for r in ok for x in r.itls_ms]),
        "tpot_ms": percentiles([statistics.fmean(r.itls_ms) for r in ok if r.itls_ms]),
        "e2e_ms": percentiles([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "first_itl_ms": percentiles([r.first_gap_ms for r in ok if r.first_gap_ms is not None]),
        "send_lag_ms": percentiles([r.send_lag_ms for r in results if r.send_lag_ms is not None]),
        "messages_with_several_tokens": sum(r.max_tokens_per_message > 1 for r in ok),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cached_prompt_tokens": sum(r.usage.get("cached_prompt_tokens", 0) for r in ok),
        "disaggregated_requests": len(disaggregated),
        "server": server,
        "kv_transfer_bytes_mean": round(kv_bytes / len(disaggregated)) if disaggregated else None,
        "kv_transfer_mib_s": round(kv_bytes / 2**20 / (kv_ms / 1e3), 1) if kv_ms > 0 else None,
        "kv_transfer_share_of_ttft": _share(share_ttft),
        "kv_transfer_share_of_first_itl": _share(share_gap),
    }


def _share(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": round(statistics.median(values), 4), "mean": round(statistics.fmean(values), 4), "n": len(values)}


RATIO_KEYS = [
    ("ttft_ms", "p50"),
    ("ttft_ms", "p90"),
    ("ttft_ms", "p99"),
    ("itl_ms", "p50"),
    ("itl_ms", "p90"),
    ("itl_ms", "p99"),
    ("tpot_ms", "p50"),
    ("first_itl_ms", "p50"),
    ("e2e_ms", "p50"),
    ("e2e_ms", "p90"),
    ("e2e_ms", "p99"),
    ("request_throughput", None),
    ("output_token_throughput", None),
    ("goodput", None),
]


def _value(run: dict[str, Any], key: str, stat: str | None) -> float | None:
    value = run.get(key)
    if stat is not None:
        value = value.get(stat) if isinstance(value, dict) else None
    return value


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    out = {}
    for key, stat in RATIO_KEYS:
        x, y = _value(a, key, stat), _value(b, key, stat)
        out[f"{key}.{stat}" if stat else key] = ratio(x, y)
    return out


def plot_cdfs(path: Path, samples: dict[str, dict[str, list[float]]], report: dict[str, Any]) -> str | None:
    """TTFT and ITL CDFs, one line per deployment; None (and a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "[serve] --plot skipped: matplotlib is not installed (pip install 'pdserve[bench]' or matplotlib)",
            file=sys.stderr,
        )
        return None
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "itl_ms", "ITL (per token)")):
        for name, values in samples.items():
            ordered = sorted(values[key])
            if ordered:
                axis.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", label=name)
        axis.set_xscale("log")
        axis.set_xlabel(f"{title}, ms (log scale)")
        axis.set_ylabel("fraction of " + ("requests" if key == "ttft_ms" else "tokens"))
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    load = report["load"]
    how = f"{load['rate']} req/s Poisson" if load["rate"] else f"concurrency {load['concurrency']}"
    figure.suptitle(f"pdserve: {load['num_requests']} requests at {how}; {report['machine']['cpu_model']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"[serve] wrote {path}", file=sys.stderr)
    return str(path)


def _cell(run: dict[str, Any], key: str, stat: str | None = None, digits: int = 1) -> str:
    value = _value(run, key, stat)
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(report: dict[str, Any]) -> None:
    runs = report["runs"]
    names = list(runs)
    load = report["load"]
    how = f"Poisson {load['rate']} req/s" if load["rate"] else f"closed loop, concurrency {load['concurrency']}"
    print(
        f"{load['num_requests']} requests, {how}; prompts {load['prompt_len'][0]}-{load['prompt_len'][1]}, "
        f"outputs {load['output_len'][0]}-{load['output_len'][1]} tokens, shared-prefix fraction "
        f"{load['shared_prefix_fraction']}; SLO TTFT {report['slo']['ttft_ms']:.0f} ms, ITL ({report['slo']['itl_stat']}) "
        f"{report['slo']['itl_ms']:.0f} ms"
    )
    ratio = report.get("ratios")
    print(f"{'':<30}" + "".join(f"{n:>16}" for n in names) + (f"{'disagg/coloc':>16}" if ratio else ""))
    for name in names:
        if "error" in runs[name]:
            print(f"{name}: {runs[name]['error']}")
    ok = [runs[n] for n in names if "error" not in runs[n]]
    if not ok:
        return
    rows = [
        ("completed", "completed", None, 0),
        ("duration s", "duration_s", None, 1),
        ("requests/s", "request_throughput", None, 3),
        ("output tok/s", "output_token_throughput", None, 1),
        ("goodput req/s", "goodput", None, 3),
        ("goodput fraction", "goodput_fraction", None, 3),
    ]
    for metric, title in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        rows += [(f"{title} {s} ms", metric, s, 1) for s in ("p50", "p90", "p99")]
    rows += [("TPOT p50 ms", "tpot_ms", "p50", 1), ("first ITL p50 ms", "first_itl_ms", "p50", 1)]
    for title, key, stat, digits in rows:
        cells = "".join(f"{_cell(runs[n], key, stat, digits) if 'error' not in runs[n] else '-':>16}" for n in names)
        rkey = f"{key}.{stat}" if stat else key
        extra = f"{ratio[rkey]:>15.2f}x" if ratio and ratio.get(rkey) is not None else (f"{'':>16}" if ratio else "")
        print(f"{title:<30}{cells}{extra}")
    for name in names:
        run = runs[name]
        if "error" in run:
            continue
        server = run["server"]
        share, gap = run["kv_transfer_share_of_ttft"], run["kv_transfer_share_of_first_itl"]
        print(
            f"{name}: {run.get('deployment', {}).get('workers', report['target'])}; errors {run['errors'] or 'none'}; "
            f"server p50 queue {_cell(server, 'queue_ms', 'p50')} ms, prefill {_cell(server, 'prefill_ms', 'p50')} ms, "
            f"KV transfer {_cell(server, 'kv_transfer_ms', 'p50')} ms; cached prompt tokens "
            f"{run['cached_prompt_tokens']}/{run['prompt_tokens']}"
        )
        if share:
            line = f"  KV transfer / TTFT: median {share['median']:.3f}, mean {share['mean']:.3f} (n={share['n']})"
            if gap:
                line += f"; KV transfer / first ITL: median {gap['median']:.3f}, mean {gap['mean']:.3f}"
            print(line + " (the first token leaves before the KV pull: the pull delays the second token)")
        handoff = run.get("handoff_ms")
        if handoff:
            print(
                f"  hand-off on the decode workers, means: admit {handoff['admit_mean']} ms, pull "
                f"{handoff['pull_mean']} ms, resume (KV landed → next token) {handoff['resume_mean']} ms "
                f"(n={handoff['num_requests']})"
            )
    m = report["machine"]
    print(
        f"machine: {m['nproc']} CPUs ({m['cpu_model']}), {m['ram_gib']} GiB, torch {m['torch']}, "
        f"GPU {m['gpu'] or 'none'}; {report.get('threads_per_worker') or '-'} thread(s) per worker"
    )
