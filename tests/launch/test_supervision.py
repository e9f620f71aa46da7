"""``pdserve up`` keeps its deployment alive: a worker, the frontend or the embedded etcd that
is SIGKILLed comes back; a worker that keeps dying is given up on while the rest serves on;
SIGTERM still stops everything, leaving no process behind. Real processes, real etcd."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.deployment import UpProcess, bound_port, etcdctl

pytestmark = pytest.mark.slow

LEASE_TTL_S = 5.0  # a worker's default lease


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _exe(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _eventually(check: Callable[[], bool], timeout: float, what: str, up: UpProcess) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}; output of up:\n{up.output[-6000:]}")
        time.sleep(0.2)


def _workers() -> list[dict]:
    listed = subprocess.run(
        [sys.executable, "-m", "pdserve", "workers", "--json"],  # through the state directory
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    return json.loads(listed.stdout)


def _etcdctl(*args: str) -> str:
    done = etcdctl(*args)  # with the tools' certificate: the embedded etcd serves mTLS
    assert done.returncode == 0, done.stderr
    return done.stdout


def _generate(port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "generate",
            "--target",
            f"127.0.0.1:{port}",
            "--token-ids",
            "4,5,6,7",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _metric(up: UpProcess, name: str, child: str) -> float:
    [line] = [line for line in up.lines if "pdserve up metrics" in line]
    port = bound_port(line)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.search(rf'^{name}_total{{child="{child}",role="[a-z]+"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _start(tmp_path: Path, model: Path, *args: str) -> tuple[UpProcess, str, int]:
    up = UpProcess(
        "up",
        "--model",
        str(model),
        "--port",
        "0",
        "--http-port",
        "-1",
        "--disaggregation",
        "always",
        "--threads-per-worker",
        "1",
        "--restart-backoff",
        "0.2s",
        *args,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    line, port = up.wait_up()
    registry = re.search(r"registry (\S+) \(embedded\)", line).group(1)
    return up, registry, port


def test_killed_children_come_back_and_sigterm_still_stops_all(checkpoints, tmp_path):
    path, _ = checkpoints("llama")
    up, registry, port = _start(tmp_path, path)
    try:
        first = {w["role"]: w["worker_id"] for w in _workers()}
        assert sorted(first) == ["decode", "prefill"]

        # A worker SIGKILLed comes back under a new id and registers again; the old id's lease runs out.
        decode_pid = int(first["decode"].rsplit("-", 1)[1])
        os.kill(decode_pid, signal.SIGKILL)
        _eventually(lambda: "decode-2 is back" in up.output, 60, "the decode worker to restart", up)

        def decode_replaced() -> bool:
            ids = [w["worker_id"] for w in _workers() if w["role"] == "decode"]
            return len(ids) == 1 and ids[0] != first["decode"]

        _eventually(decode_replaced, LEASE_TTL_S + 5, "one new decode worker in the registry", up)
        assert _metric(up, "pdserve_child_restarts", "decode-2") == 1
        result = _generate(port)
        assert result.returncode == 0, result.stderr

        # The embedded etcd SIGKILLed comes back on its URL with its data (a key no one rewrites
        # survives), and the workers are listed again.
        assert _etcdctl("put", "/pdserve-test/kept", "yes").strip() == "OK"
        [etcd_pid] = [pid for pid in _children(up.process.pid) if _exe(pid).endswith("etcd")]
        os.kill(etcd_pid, signal.SIGKILL)
        _eventually(lambda: "etcd is back" in up.output, 30, "etcd to restart", up)
        assert _etcdctl("get", "--print-value-only", "/pdserve-test/kept").strip() == "yes"
        assert sorted(w["role"] for w in _workers()) == ["decode", "prefill"]
        assert _metric(up, "pdserve_child_restarts", "etcd") == 1

        # The frontend SIGKILLed comes back on the same port.
        [frontend_pid] = [
            pid
            for pid in _children(up.process.pid)
            if "frontend" in (Path("/proc") / str(pid) / "cmdline").read_text(errors="replace")
        ]
        os.kill(frontend_pid, signal.SIGKILL)
        _eventually(lambda: "frontend is back" in up.output, 60, "the frontend to restart", up)
        result = _generate(port)
        assert result.returncode == 0, result.stderr
        assert len(json.loads(result.stdout)["token_ids"]) == 4

        # SIGTERM still drains and stops everything, etcd included.
        children = _children(up.process.pid)
        assert len(children) == 4, children  # etcd, frontend, two workers
        up.process.send_signal(signal.SIGTERM)
        assert up.process.wait(60) == 0, up.output
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if _alive(pid)], "a child outlived pdserve up"
        assert not list(tmp_path.glob("pdserve-up-*")), "the state directory outlived pdserve up"
    finally:
        up.close()


def test_a_crash_loop_is_given_up_on_and_the_rest_serves_on(checkpoints, tmp_path):
    source, _ = checkpoints("llama")
    model = tmp_path / "model"
    model.mkdir()
    for file in source.iterdir():
        (model / file.name).symlink_to(file)
    up, registry, port = _start(tmp_path, model, "--max-restarts", "2")
    try:
        [decode] = [w for w in _workers() if w["role"] == "decode"]
        (model / "config.json").unlink()
        (model / "config.json").write_text("{not json")  # every restart of the worker now fails
        os.kill(int(decode["worker_id"].rsplit("-", 1)[1]), signal.SIGKILL)
        _eventually(lambda: "giving up on it after 2 restarts in a row" in up.output, 120, "the give-up", up)
        assert _metric(up, "pdserve_child_restarts", "decode-2") == 2
        assert _metric(up, "pdserve_child_crashes", "decode-2") == 3
        assert _metric(up, "pdserve_child_gave_up", "decode-2") == 1
        assert up.process.poll() is None, "pdserve up stopped"
        # The dead worker's entry leaves with its lease; the frontend then has no decode worker.
        _eventually(lambda: not any(w["role"] == "decode" for w in _workers()), 30, "the lease", up)
        result = _generate(port)  # the frontend answers: there is no decode worker
        assert result.returncode != 0 and "no decode worker" in result.stderr, result.stderr
        up.process.send_signal(signal.SIGTERM)
        assert up.process.wait(60) == 0, up.output
    finally:
        up.close()
