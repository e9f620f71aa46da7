"""``bench.cpu_linear`` runs (one layer, two row counts) and reports each system, another
build of the kernel too."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.kernels.cpu import panel_gemm

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not panel_gemm.available(), reason="this CPU has no AVX-512")
def test_a_short_run_reports_both_systems_per_row_count():
    result = subprocess.run(
        [sys.executable, "-m", "bench.cpu_linear", "--rows", "1,20", "--layers", "1", "--reps", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert [r["rows"] for r in report["results"]] == [1, 20]
    for row in report["results"]:
        assert row["onednn"]["ms"] > 0 and row["panels"]["gflops"] > 0 and row["onednn_over_panels"] > 0


@pytest.mark.slow
def test_bad_rows_are_refused_by_name():
    result = subprocess.run(
        [sys.executable, "-m", "bench.cpu_linear", "--rows", "1,x"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2 and "--rows" in result.stderr


@pytest.mark.skipif(not panel_gemm.available(), reason="this CPU has no AVX-512")
def test_a_run_against_another_build_reports_it_as_a_third_system(tmp_path):
    against = tmp_path / "panel_gemm.c"
    shutil.copy(Path(panel_gemm.__file__).with_suffix(".c"), against)  # no header beside it: this tree's
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.cpu_linear",
            "--rows",
            "3",
            "--layers",
            "1",
            "--reps",
            "1",
            "--against",
            str(against),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (row,) = json.loads(result.stdout)["results"]
    assert row["against"]["gflops"] > 0 and row["against_over_panels"] > 0


@pytest.mark.slow
def test_a_missing_against_file_is_named(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bench.cpu_linear", "--against", str(tmp_path / "nowhere.c")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2 and "--against" in result.stderr
