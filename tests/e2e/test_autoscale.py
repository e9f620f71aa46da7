"""``pdserve up --autoscale`` as a user runs it: a burst grows the decode pool, the lull after shrinks it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.v1 import inference_pb2, inference_pb2_grpc
from tests.e2e.deployment import UpProcess

pytestmark = pytest.mark.slow

# Fast enough for a test: decide every second, cool down over a few, forget bursts quickly.
PLANNER_CONFIG = {
    "warmup_intervals": 1,
    "up_cooldown_intervals": 1,
    "down_cooldown_intervals": 3,
    "startup_s": 5,
    "drain_s": 5,
    "forecast": {"burst_memory_s": 4, "burst_max_s": 4, "burst_bin_s": 1},
}


def _decode_sizes(lines: list[str]) -> list[int]:
    return [int(m) for m in re.findall(r"scaled to \d+ prefill \+ (\d+) decode workers", "".join(lines))]


def _burst(port: int, model: str, seconds: float) -> None:
    """16 concurrent streams at a time for ``seconds``: more than one decode worker's 4 slots."""

    def one(i: int) -> None:
        request = inference_pb2.GenerateRequest(
            model=model,
            token_ids=inference_pb2.TokenIds(ids=[3 + i % 50, 4, 5, 6]),
            sampling=inference_pb2.SamplingOptions(max_tokens=48, ignore_eos=True),
        )
        list(stub.Generate(request, timeout=60))

    end = time.monotonic() + seconds
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, ThreadPoolExecutor(16) as pool:
        stub = inference_pb2_grpc.InferenceStub(channel)
        while time.monotonic() < end:
            list(pool.map(one, range(16)))


def test_up_autoscale_grows_the_decode_pool_under_a_burst_and_shrinks_it_after(checkpoints, tmp_path):
    path, _ = checkpoints("llama")
    profile = tmp_path / "profile.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "profile",
            "--model",
            str(path),
            "--out",
            str(profile),
            "--num-threads",
            "1",
            "--prompt-lengths",
            "16,64",
            "--batch-sizes",
            "1,4",
            "--context-lengths",
            "32",
            "--repeats",
            "1",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    config = tmp_path / "planner.json"
    config.write_text(json.dumps(PLANNER_CONFIG))
    # An ITL target a burst on one decode worker breaks (its steps take 5-6 ms here): 16 streams
    # wait for its 4 slots.
    up = UpProcess(
        "--log-level",
        "INFO",
        "up",
        "--model",
        str(path),
        "--port",
        "0",
        "--http-port",
        "0",
        "--disaggregation",
        "always",
        "--threads-per-worker",
        "1",
        "--max-num-seqs",
        "4",
        "--autoscale",
        "--profile",
        str(profile),
        "--planner-config",
        str(config),
        "--ttft-p90",
        "2s",
        "--itl-p90",
        "4ms",
        "--max-decode",
        "3",
        "--planner-interval",
        "1s",
        "--stats-window",
        "2s",
    )
    lines = up.lines
    try:
        _, port = up.wait_up()
        _burst(port, path.name, seconds=8)
        # The planner decides during the burst; the new worker may still be loading after it.
        deadline = time.monotonic() + 60
        while (
            max(_decode_sizes(lines), default=1) < 2 and "decode 1→2" in "".join(lines) and time.monotonic() < deadline
        ):
            time.sleep(0.5)
        grown = max(_decode_sizes(lines), default=1)
        assert grown >= 2, f"the decode pool did not grow under the burst:\n{''.join(lines)}"
        deadline = time.monotonic() + 60
        while not (_decode_sizes(lines) and _decode_sizes(lines)[-1] == 1) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _decode_sizes(lines)[-1] == 1, f"the decode pool did not shrink back:\n{''.join(lines)}"
        assert "ITL p90" in "".join(lines)  # every decision is logged with its reason
        up.process.send_signal(signal.SIGINT)
        assert up.process.wait(60) == 0, up.output
    finally:
        up.close()
