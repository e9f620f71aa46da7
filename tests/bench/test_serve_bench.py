"""``bench.serve``: its timing and goodput rules on made-up streams, and one real --compare run
on the tiny Llama (a few requests) checked against its JSON contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib.load import BenchRequest, RequestResult, WorkloadSpec, make_requests
from bench.serve_report import summarise

ROOT = Path(__file__).resolve().parents[2]


def _stream(index: int, messages: list[tuple[float, int]]) -> RequestResult:
    result = RequestResult(index, sent_at=0.0)
    for at, num_tokens in messages:
        result.on_message(at, num_tokens)
    result.ended_at, result.e2e_ms = messages[-1][0], messages[-1][0] * 1e3
    result.breakdown = {
        "disaggregated": False,
        "queue_ms": 0.0,
        "prefill_ms": 1.0,
        "ttft_ms": 1.0,
        "kv_transfer_ms": 0.0,
        "kv_transfer_bytes": 0,
    }
    return result


def test_a_message_of_several_tokens_splits_its_gap_and_the_first_messages_extra_tokens_have_none():
    result = _stream(0, [(0.1, 2), (0.3, 1), (0.6, 3), (0.6, 0)])
    assert result.ttft_ms == pytest.approx(100)
    assert result.itls_ms == pytest.approx([200, 100, 100, 100])
    assert result.first_gap_ms == pytest.approx(200)
    assert result.num_tokens == 6 and result.num_messages == 4 and result.max_tokens_per_message == 3


def test_goodput_needs_both_slos_and_judges_a_request_by_its_p90_or_mean_itl():
    steady = _stream(0, [(0.1, 1)] + [(0.1 + 0.01 * i, 1) for i in range(1, 11)])  # ITLs 10 ms
    bursty = _stream(
        1, [(0.1, 1)] + [(0.1 + t, 1) for t in (0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.18, 0.28)]
    )
    late = _stream(2, [(2.0, 1), (2.01, 1)])  # TTFT 2 s
    failed = RequestResult(3, sent_at=0.0, error="UNAVAILABLE")
    requests = [BenchRequest(i, [5, 6, 7], 11, None) for i in range(4)]
    results = [steady, bursty, late, failed]
    by_p90 = summarise(results, 2.0, requests, ttft_slo_ms=500, itl_slo_ms=50, itl_stat="p90")
    assert by_p90["goodput"] == pytest.approx(0.5) and by_p90["goodput_fraction"] == 0.25  # bursty's p90 is 100 ms
    by_mean = summarise(results, 2.0, requests, ttft_slo_ms=500, itl_slo_ms=50, itl_stat="mean")
    assert by_mean["goodput"] == pytest.approx(1.0)  # bursty's mean is 28 ms
    assert by_p90["errors"] == {"UNAVAILABLE": 1} and by_p90["completed"] == 3
    assert by_p90["short_outputs"] == 1  # late asked for 11 tokens and got 2


def test_the_workload_is_seeded_within_its_ranges_and_shares_prefixes():
    spec = WorkloadSpec(
        num_requests=200,
        num_warmup=3,
        prompt_len=(40, 60),
        output_len=(5, 9),
        shared_prefix_fraction=0.5,
        prefix_len=32,
        num_prefixes=2,
        seed=3,
    )
    warmup, requests = make_requests(spec, vocab_size=1000)
    assert (warmup, requests) == make_requests(spec, vocab_size=1000)
    assert all(40 <= len(r.prompt) <= 60 and 5 <= r.max_tokens <= 9 for r in requests)
    assert all(3 <= t < 1000 for r in requests for t in r.prompt)
    shared = [r for r in requests if r.shared_prefix is not None]
    assert 70 <= len(shared) <= 130 and {r.shared_prefix for r in shared} == {0, 1}
    for r in shared:
        assert r.prompt[:32] == next(s for s in shared if s.shared_prefix == r.shared_prefix).prompt[:32]
    assert len(warmup) == 3 and all(r.shared_prefix is None and 2 <= r.max_tokens <= 8 for r in warmup)


@pytest.mark.slow
def test_compare_run_reports_both_deployments_side_by_side(checkpoints):
    path, _ = checkpoints("llama")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.serve",
            "--model",
            str(path),
            "--compare",
            "--concurrency",
            "2",
            "--num-requests",
            "4",
            "--warmup",
            "2",
            "--prompt-len",
            "8:40",
            "--output-len",
            "3:6",
            "--shared-prefix-fraction",
            "0.5",
            "--prefix-len",
            "16",
            "--ttft-slo",
            "30s",
            "--itl-slo",
            "10s",
            "--max-num-seqs",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)  # exactly one JSON object on stdout
    assert report["served_model"]["vocab_size"] == 320 and report["load"]["num_requests"] == 4
    runs = report["runs"]
    assert set(runs) == {"disaggregated", "colocated"}
    for name, run in runs.items():
        assert "error" not in run, run
        assert run["completed"] == 4 and run["errors"] == {} and run["short_outputs"] == 0, name
        assert run["warmup_errors"] == {}
        assert run["request_throughput"] > 0 and run["output_token_throughput"] > 0
        assert run["goodput"] == run["request_throughput"] and run["goodput_fraction"] == 1.0  # generous SLOs
        for metric in ("ttft_ms", "itl_ms", "e2e_ms"):
            stats = run[metric]
            assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"], (name, metric)
        assert run["ttft_ms"]["n"] == 4 and run["e2e_ms"]["p50"] >= run["ttft_ms"]["p50"]
        assert run["server"]["prefill_ms"]["n"] == 4
    disaggregated, colocated = runs["disaggregated"], runs["colocated"]
    assert disaggregated["deployment"]["num_prefill"] == 1 and disaggregated["deployment"]["num_decode"] == 1
    assert colocated["deployment"]["num_prefill"] == 0 and colocated["deployment"]["num_decode"] == 2
    assert disaggregated["disaggregated_requests"] == 4 and colocated["disaggregated_requests"] == 0
    assert disaggregated["kv_transfer_bytes_mean"] > 0 and disaggregated["server"]["kv_transfer_ms"]["p50"] > 0
    share = disaggregated["kv_transfer_share_of_ttft"]
    assert share["n"] == 4 and share["median"] > 0 and colocated["kv_transfer_share_of_ttft"] is None
    handoff = disaggregated["handoff_ms"]  # the decode worker's phases, warm-up requests included
    assert handoff["num_requests"] >= 4 and handoff["pull_mean"] > 0 and handoff["resume_mean"] > 0
    assert "handoff_ms" not in colocated
    # Both deployments saw the same workload.
    assert disaggregated["prompt_tokens"] == colocated["prompt_tokens"]
    assert disaggregated["output_tokens"] == colocated["output_tokens"]
    assert report["ratios"]["ttft_ms.p50"] > 0 and report["ratios"]["goodput"] > 0
    machine = report["machine"]
    assert machine["nproc"] >= 1 and machine["torch"] and machine["cpu_model"] and "gpu" in machine
