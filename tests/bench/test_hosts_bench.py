"""``bench.hosts`` runs tiny (one small pull, one all_reduce size) and reports both placements."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib.hosts import unavailable

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(unavailable() is not None, reason=f"separate hosts unavailable: {unavailable()}")
def test_a_tiny_run_reports_across_and_within_hosts():
    argv = [sys.executable, "-m", "bench.hosts", "--json", "--layouts", "smollm2-135m", "--tokens", "32"]
    argv += ["--kv-reps", "1", "--sizes", "4096", "--reps", "3"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    (kv,) = report["kv"]
    assert kv["layout"] == "smollm2-135m" and kv["tokens"] == 32 and kv["bytes"] > 0
    assert kv["across_scattered_gbps"] > 0 and kv["within_scattered_gbps"] > 0 and kv["across_over_within"] > 0
    assert [row["bytes"] for row in report["all_reduce"]] == [4096]
    assert report["all_reduce"][0]["across_us"] > 0 and report["all_reduce"][0]["within_us"] > 0


def test_sizes_that_are_not_whole_floats_are_refused_by_name():
    result = subprocess.run(
        [sys.executable, "-m", "bench.hosts", "--sizes", "4096,10"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2 and "--sizes" in result.stderr
