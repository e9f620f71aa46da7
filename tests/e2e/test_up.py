"""``pdserve up`` as a user runs it: one command, the embedded registry, Ctrl-C stops everything."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.e2e.deployment import UpProcess, rank_children
from tests.utils.checkpoints import reference_greedy

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_serves_with_the_embedded_registry_and_stops_every_child(checkpoints, tmp_path):
    path, _ = checkpoints("llama")
    up = UpProcess(
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
        "8",
        env={**os.environ, "TMPDIR": str(tmp_path), "PDSERVE_API_KEYS": "sk-up"},
    )
    try:
        up_line, port = up.wait_up()
        assert "(embedded)" in up_line
        # The OpenAI API's base URL is on the line, and the key from the environment guards it.
        base_url = re.search(r"OpenAI API on (http://\S+/v1);", up_line).group(1)
        models = urllib.request.Request(f"{base_url}/models", headers={"Authorization": "Bearer sk-up"})
        with urllib.request.urlopen(models, timeout=10) as answer:
            assert [m["id"] for m in json.loads(answer.read())["data"]] == [path.name]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{base_url}/models", timeout=10)
        assert refused.value.code == 401
        assert "sk-up" not in up.output  # keys are never logged
        pids = [int(m) for m in re.findall(r"worker (?:prefill|decode)-\S+-(\d+) listening", up.output)]
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        # The engine option reached both workers, inside the configuration each was started with.
        listed = subprocess.run(
            [sys.executable, "-m", "pdserve", "workers", "--json"],  # through the state directory
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 0, listed.stderr
        assert sorted((w["role"], w["max_num_seqs"]) for w in json.loads(listed.stdout)) == [
            ("decode", 8),
            ("prefill", 8),
        ]
        written = sorted(p.name for p in tmp_path.glob("pdserve-up-*/*.json"))
        assert written == ["decode.json", "frontend.json", "prefill.json"]
        generate = [
            sys.executable,
            "-m",
            "pdserve",
            "generate",
            "--target",
            f"127.0.0.1:{port}",
            "--token-ids",
            "4,5,6,7",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
        ]
        keyless = subprocess.run(generate, capture_output=True, text=True, timeout=60)
        assert keyless.returncode == 1 and "UNAUTHENTICATED" in keyless.stderr
        result = subprocess.run(
            generate, capture_output=True, text=True, timeout=60, env={**os.environ, "PDSERVE_API_KEY": "sk-up"}
        )
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        assert len(out["token_ids"]) == 5 and out["breakdown"]["disaggregated"]
        up.process.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            code = up.process.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"pdserve up did not stop within 60 s of Ctrl-C:\n{up.output}")
        assert code == 0, up.output
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids), "a worker outlived pdserve up"
        assert not list(tmp_path.glob("pdserve-up-*")), "the children's configuration files outlived pdserve up"
    finally:
        up.close()


def test_up_refuses_a_directory_without_a_model(tmp_path):
    up = subprocess.run(
        [sys.executable, "-m", "pdserve", "up", "--model", str(tmp_path), "--port", "0", "--http-port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert up.returncode == 2 and "no config.json in model directory" in up.stderr


def test_up_refuses_a_port_in_use_before_starting_anything(checkpoints):
    path, _ = checkpoints("llama")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        up = subprocess.run(
            [sys.executable, "-m", "pdserve", "up", "--model", str(path), "--port", str(port), "--http-port", "0"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert up.returncode == 2 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in up.stderr
    assert "worker" not in up.stdout + up.stderr.split("error:")[0]  # nothing was started


def test_up_reports_a_worker_that_cannot_start_and_stops_the_rest(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    up = subprocess.run(
        [sys.executable, "-m", "pdserve", "up", "--model", str(tmp_path), "--port", "0", "--http-port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert up.returncode == 1
    assert "exited; its last output" in up.stderr and "config.json" in up.stderr
    assert "Traceback" not in up.stderr.split("pdserve up: error:")[-1]


def _generate(port: int, prompt: list[int]) -> dict:
    """``pdserve generate --json``'s answer for 6 greedy tokens of ``prompt``."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "generate",
            "--target",
            f"127.0.0.1:{port}",
            "--token-ids",
            ",".join(map(str, prompt)),
            "--max-tokens",
            "6",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _stop_and_check_every_rank_exits(up: UpProcess, pids: list[int]) -> None:
    """Ctrl-C stops ``pdserve up`` cleanly, and every worker and rank in ``pids`` with it."""
    up.process.send_signal(signal.SIGINT)
    try:
        code = up.process.wait(90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pdserve up did not stop within 90 s of Ctrl-C:\n{up.output}")
    assert code == 0, up.output
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "a worker or one of its ranks outlived pdserve up"


def test_up_runs_tensor_parallel_pools_and_stops_every_rank(checkpoints, tmp_path):
    from pdserve import LLM, SamplingParams

    path, _ = checkpoints("llama")
    up = UpProcess(
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
        "--prefill-tensor-parallel-size",
        "2",
        "--decode-tensor-parallel-size",
        "2",
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    try:
        up_line, port = up.wait_up()
        pids = [int(m) for m in re.findall(r"worker (?:prefill|decode)-\S+-(\d+) listening", up.output)]
        ranks = rank_children(pids)
        assert len(pids) == 2 and len(ranks) == 2  # one more rank in each pool
        listed = subprocess.run(
            [sys.executable, "-m", "pdserve", "workers", "--json"],  # through the state directory
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 0, listed.stderr
        sizes = sorted((w["role"], w["tensor_parallel_size"]) for w in json.loads(listed.stdout))
        assert sizes == [("decode", 2), ("prefill", 2)]
        prompt = list(range(4, 40))
        out = _generate(port, prompt)
        want = LLM(str(path)).generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        assert out["token_ids"] == want.token_ids
        assert out["breakdown"]["disaggregated"] and out["breakdown"]["kv_transfer_bytes"] > 0
        _stop_and_check_every_rank_exits(up, pids + ranks)
    finally:
        up.close()


def test_up_runs_data_parallel_expert_parallel_pools_and_stops_every_rank(checkpoints, tmp_path):
    path, hf_model = checkpoints("deepseek_v3")
    up = UpProcess(
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
        "--prefill-data-parallel-size",
        "2",
        "--decode-data-parallel-size",
        "2",
        "--enable-expert-parallel",
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    try:
        up_line, port = up.wait_up()
        pids = [int(m) for m in re.findall(r"worker (?:prefill|decode)-\S+-(\d+) listening", up.output)]
        ranks = rank_children(pids, "pdserve.worker.data_parallel")
        assert len(pids) == 2 and len(ranks) == 2  # one more rank in each pool
        listed = subprocess.run(
            [sys.executable, "-m", "pdserve", "workers", "--json"],  # through the state directory
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 0, listed.stderr
        assert sorted(w["role"] for w in json.loads(listed.stdout)) == ["decode", "decode", "prefill", "prefill"]
        prompt = list(range(4, 40))
        out = _generate(port, prompt)
        reference, num_clear = reference_greedy(hf_model, prompt, 6)
        assert num_clear >= 3 and out["token_ids"][:num_clear] == reference[:num_clear]
        assert out["breakdown"]["disaggregated"] and out["breakdown"]["kv_transfer_bytes"] > 0
        _stop_and_check_every_rank_exits(up, pids + ranks)
        assert "cannot serve" not in up.output, up.output  # the ranks left their lockstep together
    finally:
        up.close()
