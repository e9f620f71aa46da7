"""The GPU kit: every check that needs a GPU, in one run that fits a short lease.

    bench/gpu_check.sh [--out DIR] [--budget SECONDS]      # on a GPU machine
    bench/gpu_check.sh --dry --out DIR                      # on CPU: tiny sizes, tests the kit itself

Steps, in this order (correctness first, then the timings):

- ``kernel_tests``: tests/kernels compiled on the GPU (not Triton's interpreter), slow ones
  included: the FP8 block GEMM against its reference, the sm_90 compile of every kernel, and
  greedy parity of every architecture on the Triton backend against the torch backend (which
  tests/model holds to transformers), GGUF and FP8 checkpoints too;
- ``decode_b{1,32,128}`` (the kernel roofline runs before batch 128): bench/offline.py on a Llama-3.1-8B-shaped random bf16 checkpoint
  (initialised on the GPU, written to /dev/shm), 128-token prompts and 128 new tokens per
  request, at batch 1, 32 and 128;
- ``decode_profile`` (after batch 1): bench/decode_profile.py, a batch-1 decode step's device time
  against its wall time, and kernels per token, on 8 of the 8B shape's layers;
- ``kernels_bench``: bench/kernels.py, decode attention and GEMMs as a fraction of this GPU's
  measured bandwidth and matmul peak;
- ``kv_pull``: bench/kv_transfer.py between two processes on this machine (host memory), when
  nixl is installed; otherwise recorded as skipped.

Each step runs as a child process with its own deadline, cut to what is left of ``--budget``,
so a hung kernel or a slow checkpoint write costs that step, not the run. The run writes
``gpu_check.json`` (machine facts and one record per step: status, seconds, results) and
``gpu_check.log`` (every step's output) into ``--out``. Exit status: 0 when every step that ran
passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: float
    junit: Path | None = None  # a pytest step's report, read for pass/fail counts
    json_stdout: bool = False  # a bench step that prints one JSON value
    skip_reason: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def _pytest(out: Path, name: str, args: list[str], timeout_s: float, workers: int) -> Step:
    junit = out / f"{name}.xml"
    parallel = ["-n", str(workers)] if workers > 1 and importlib.util.find_spec("xdist") else []
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *parallel, *args]
    return Step(name, argv, timeout_s, junit=junit)


def _decode(name: str, checkpoint: Path, batch: int, dry: bool, first: bool) -> Step:
    if dry:
        shape = ["--shape", "tiny", "--num-layers", "1"]
        dtype = ["--dtype", "float32"]
        lengths = ["--prompt-len-min", "16", "--prompt-len-max", "16", "--output-len-min", "4", "--output-len-max", "4"]
    else:
        shape, dtype = ["--shape", "llama-3.1-8b"], ["--dtype", "bfloat16"]
        lengths = ["--prompt-len-min", "128", "--prompt-len-max", "128"]
        lengths += ["--output-len-min", "128", "--output-len-max", "128"]
    source = [*shape, "--keep-checkpoint", str(checkpoint)] if first else ["--model", str(checkpoint)]
    argv = [sys.executable, "-m", "bench.offline", *source, *dtype, *lengths]
    argv += ["--num-requests", str(batch), "--repeats", "2", "--skip-transformers", "--check-requests", "0", "--json"]
    return Step(name, argv, 150 if first else 60, json_stdout=True)


def checkpoint_dir() -> Path:
    """Where the 16 GB checkpoint goes: memory-backed where there is one, never under --out."""
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())) / "pdserve-gpu-check"


def plan(out: Path, dry: bool, checkpoint: Path) -> list[Step]:
    kernel_dir = "tests/kernels"
    if dry:
        tests = [f"{kernel_dir}/test_rms_norm.py", f"{kernel_dir}/test_engine_triton.py", "-m", "not slow"]
        kernel_tests = _pytest(out, "kernel_tests", tests, 120, 1)
    else:
        # Slow tests included: the greedy parity of every architecture is among them.
        tests = [kernel_dir, f"--ignore={kernel_dir}/cpu", "--timeout=150"]
        kernel_tests = _pytest(out, "kernel_tests", tests, 200, 12)
    bench_argv = [sys.executable, "-m", "bench.kernels", "--json"] + (["--smoke", "--only", "rms"] if dry else [])
    batches = (1, 2) if dry else (1, 32, 128)
    decodes = [_decode(f"decode_b{b}", checkpoint, b, dry, first=i == 0) for i, b in enumerate(batches)]
    # The kernel roofline before the largest batch, so that a short budget cuts the latter.
    profile_argv = [sys.executable, "-m", "bench.decode_profile", "--json"] + (
        ["--num-layers", "1", "--tokens", "8"] if dry else []
    )
    profile = Step("decode_profile", profile_argv, 120, json_stdout=True)
    steps = [kernel_tests, decodes[0], profile, *decodes[1:-1]]
    steps.append(Step("kernels_bench", bench_argv, 60 if dry else 100, json_stdout=True))
    steps.append(decodes[-1])
    kv_argv = [sys.executable, "-m", "bench.kv_transfer", "--json", "--reps", "5"]
    kv_argv += ["--layouts", "smollm2-135m", "--tokens", "304"] if dry else []
    kv = Step("kv_pull", kv_argv, 90, json_stdout=True)
    if importlib.util.find_spec("nixl") is None:
        kv.skip_reason = "nixl is not installed"
    steps.append(kv)
    return steps


def machine_facts() -> dict[str, object]:
    facts: dict[str, object] = {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()}
    try:
        import torch

        facts["torch"] = torch.__version__
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            facts["gpu"] = props.name
            facts["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
            facts["sms"] = props.multi_processor_count
    except ImportError as error:
        facts["torch"] = f"not importable: {error}"
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = None
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,driver_version,memory.total,clocks.max.sm"
        smi = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True)
        facts["nvidia_smi"] = smi.stdout.strip()
    return facts


def _junit_counts(path: Path) -> dict[str, int]:
    suites = ET.parse(path).getroot()
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites.iter("testsuite"):
        for key in totals:
            totals[key] += int(suite.get(key, 0))
    return totals


def _parse_json(stdout: str) -> object:
    """The step's JSON: the whole output, or its last line where something printed before it."""
    for text in (stdout, stdout.strip().rsplit("\n", 1)[-1]):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            continue
    return {"unparsed_output_tail": stdout[-2000:]}


def _errors(result: object) -> list[str]:
    """Errors a bench reports inside its JSON (bench/offline.py records a failed system so)."""
    if not isinstance(result, dict):
        return []
    found = [str(result["error"])] if "error" in result else []
    return found + [
        f"{key}: {value['error']}" for key, value in result.items() if isinstance(value, dict) and "error" in value
    ]


def run_step(step: Step, deadline: float, log) -> dict[str, object]:
    record: dict[str, object] = {"name": step.name, "argv": step.argv[1:]}
    if step.skip_reason:
        return record | {"status": "skipped", "why": step.skip_reason}
    timeout = min(step.timeout_s, deadline - time.monotonic())
    if timeout < 10:
        return record | {"status": "skipped", "why": "out of budget"}
    log.write(f"\n===== {step.name} (deadline {timeout:.0f} s): {' '.join(step.argv[1:])}\n")
    log.flush()
    started = time.monotonic()
    env = os.environ | step.env
    try:
        done = subprocess.run(
            step.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout
        )
        stdout, rc = done.stdout, done.returncode
    except subprocess.TimeoutExpired as expired:
        raw = expired.stdout or ""
        stdout, rc = raw if isinstance(raw, str) else raw.decode(errors="replace"), None
    log.write(stdout)
    record["seconds"] = round(time.monotonic() - started, 1)
    record["status"] = "timed out" if rc is None else ("passed" if rc == 0 else f"failed (exit {rc})")
    if step.junit is not None and step.junit.exists():
        record["tests"] = _junit_counts(step.junit)
    if step.json_stdout and rc == 0:
        record["result"] = _parse_json(stdout)
        if _errors(record["result"]):
            record["status"] = f"failed ({'; '.join(_errors(record['result']))})"
    print(f"{step.name}: {record['status']} in {record['seconds']} s", flush=True)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/gpu_check.sh", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="folder for the JSON and the log")
    parser.add_argument("--budget", type=float, default=470, help="seconds for all steps together (default: 470)")
    parser.add_argument("--steps", default="", help="comma-separated step names to run (default: all)")
    parser.add_argument("--dry", action="store_true", help="tiny sizes on CPU: check the kit, not the GPU")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not args.dry:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; use --dry to check the kit on CPU", file=sys.stderr)
            return 2
    deadline = time.monotonic() + args.budget
    report: dict[str, object] = {"dry": args.dry, "machine": machine_facts(), "steps": []}
    checkpoint = checkpoint_dir()
    try:
        with open(out / "gpu_check.log", "w") as log:
            chosen = set(filter(None, args.steps.split(",")))
            for step in plan(out, args.dry, checkpoint):
                if chosen and step.name not in chosen:
                    continue
                report["steps"].append(run_step(step, deadline, log))  # type: ignore[union-attr]
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    bad = [s["name"] for s in report["steps"] if s["status"] not in ("passed", "skipped")]  # type: ignore[union-attr,index]
    print(f"gpu_check: {'all steps passed' if not bad else 'not passed: ' + ', '.join(bad)}; {out / 'gpu_check.json'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
