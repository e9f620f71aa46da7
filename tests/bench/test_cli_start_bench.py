"""``bench.cli_start`` times a real ``pdserve generate --target`` against its own server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_round_reports_the_request_before_the_exit():
    result = subprocess.run(
        [sys.executable, "-m", "bench.cli_start", "--json", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert 0 < report["median_to_request_s"] <= report["median_to_exit_s"]
    assert report["median_cpu_s"] > 0 and report["cpu_model"]
