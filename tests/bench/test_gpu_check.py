"""The GPU kit's dry mode runs here, on CPU, so that the day a GPU is lent the kit works first time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check import Step, plan, run_step

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_plan_runs_every_check_of_the_kit(tmp_path):
    steps = {step.name: step for step in plan(tmp_path, dry=False, checkpoint=tmp_path / "ckpt")}
    assert list(steps) == [
        "kernel_tests",
        "decode_b1",
        "decode_profile",
        "decode_b32",
        "kernels_bench",
        "decode_b128",
        "kv_pull",
    ]
    # Compiled kernel tests, slow ones (every architecture's greedy parity) included.
    assert "tests/kernels" in steps["kernel_tests"].argv and "not slow" not in steps["kernel_tests"].argv
    assert "llama-3.1-8b" in steps["decode_b1"].argv and "--model" in steps["decode_b128"].argv


def test_a_step_that_fails_or_prints_no_json_is_recorded_not_raised(tmp_path):
    log = (tmp_path / "log").open("w")
    failing = Step("boom", [sys.executable, "-c", "print('half a line'); raise SystemExit(3)"], 30, json_stdout=True)
    record = run_step(failing, deadline=float("inf"), log=log)
    assert record["status"] == "failed (exit 3)" and "result" not in record
    noisy = Step("noisy", [sys.executable, "-c", "print('warming up'); print('[1, 2]')"], 30, json_stdout=True)
    assert run_step(noisy, deadline=float("inf"), log=log)["result"] == [1, 2]
    assert run_step(Step("late", ["true"], 30), deadline=0, log=log)["status"] == "skipped"
    # bench/offline.py exits 0 and names a system that failed inside its JSON.
    inner = Step(
        "inner", [sys.executable, "-c", 'print(\'{"pdserve": {"error": "worker exited"}}\')'], 30, json_stdout=True
    )
    assert run_step(inner, deadline=float("inf"), log=log)["status"] == "failed (pdserve: worker exited)"


@pytest.mark.slow
def test_the_dry_run_passes_and_writes_its_report(tmp_path):
    env = os.environ | {"GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--dry", "--out", str(tmp_path / "out")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    statuses = {step["name"]: step["status"] for step in report["steps"]}
    assert statuses == dict.fromkeys(
        ["kernel_tests", "decode_b1", "decode_profile", "kernels_bench", "decode_b2", "kv_pull"], "passed"
    )
    decode = next(step for step in report["steps"] if step["name"] == "decode_b2")
    assert (
        decode["result"]["output_tokens"] == 8
        and decode["result"]["prompt_tokens"] == 32
        and decode["result"]["pdserve"]["output_tok_s"] > 0
    )
    assert (tmp_path / "out" / "gpu_check.log").stat().st_size > 0
