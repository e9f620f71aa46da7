"""``bench.cpu_attention`` runs (two layers, a small cache), against another build of the
kernel too, and refuses what it cannot run by name."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.kernels.cpu import paged_decode

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.cpu_attention", "--layers", "2", "--reps", "1", "--cache-gib", "0.1", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


@pytest.mark.slow
def test_a_short_run_against_another_build_reports_both(tmp_path):
    against = tmp_path / "paged_decode.c"
    shutil.copy(Path(paged_decode.__file__).with_suffix(".c"), against)  # no header beside it: this tree's
    result = _run("--against", str(against), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["prompt_batch"]["tokens"] == 2048
    for case in ("decode", "decode_hot", "prompt"):
        assert report[case]["current"]["ms_per_layer"] > 0 and report[case]["against_over_current"] > 0
    assert report["decode"]["current"]["gb_s"] > 0 and report["prompt"]["against"]["gflops"] > 0


@pytest.mark.slow
def test_a_missing_file_and_a_small_cache_are_named(tmp_path):
    missing = _run("--against", str(tmp_path / "nowhere.c"))
    assert missing.returncode == 2 and "--against" in missing.stderr
    small = _run("--cache-gib", "0.001")
    assert small.returncode == 2 and "--cache-gib" in small.stderr
