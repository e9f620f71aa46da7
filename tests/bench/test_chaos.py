"""``bench.chaos``: a one-minute soak on the tiny Llama (2 prefill + 2 decode workers, faults
every few seconds) meets the soak's targets: nothing hangs, no KV block leaks on any worker,
every failure is explained by a deadline or by the migration attempts running out, and the
deployment ends with its workers registered again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_short_chaos_soak_hangs_nothing_leaks_nothing_and_explains_every_failure():
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.chaos",
            "--duration",
            "60",
            "--fault-interval",
            "6",
            "--concurrency",
            "4",
            "--seed",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout)
    assert report["sent"] > 0 and report["completed"] > 0
    assert sum(report["faults"].values()) >= 3, report["faults"]
    assert report["hung"] == 0, report
    assert report["failed_by_cause"]["unexplained"] == 0, report["unexplained_failures"]
    assert not any(report["leaked_blocks"].values()), report["leaked_blocks"]
    assert report["live_workers_at_end"] == {"prefill": 2, "decode": 2}, report
    assert report["completed"] + report["failed"] == report["sent"]
