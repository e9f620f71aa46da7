"""``bench.all_to_all`` runs on two gloo ranks (its smoke mode) and reports every exchange."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_run_over_two_ranks_reports_each_exchange():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "bench.all_to_all",
            "--smoke",
            "--json",
            "--repeats",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 2
    assert set(report["median_over_ranks"]) == {"counts_ms", "dispatch_rows_ms", "dispatch_ids_ms", "combine_ms"}
    assert all(v > 0 for v in report["median_over_ranks"].values())
    assert report["dispatch_gbps_per_rank"] > 0
