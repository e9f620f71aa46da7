"""The commands the operator gives its pods run a real worker: the pool's arguments file
(``pdserve @FILE``) starts it, and the preStop command drains it from inside the pod."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.operator import args as cmd
from pdserve.operator.spec import parse_spec

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_args_file_starts_a_worker_and_the_prestop_drains_it(etcd_url: str, checkpoints, tmp_path: Path) -> None:
    path, _ = checkpoints("llama")
    spec = parse_spec(
        {
            "spec": {
                "model": {"path": str(path), "name": "org/operator-pod"},
                "image": "pdserve:test",
                "decode": {"engineArgs": {"kvCacheMemory": "16M", "numThreads": 1, "drainTimeout": "20s"}},
            }
        }
    )
    args_file = tmp_path / "decode.args"
    args_file.write_text(cmd.args_file(cmd.worker_args(spec, "decode", etcd_url)))
    port = _free_port()
    # What only the pod knows comes after the file, as in the pod; here loopback instead of the pod's IP.
    pod_args = ["--worker-id", "decode-pod-0", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1"]
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_ETCD"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "pdserve", f"@{args_file}", *pod_args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert worker.poll() is None, f"the worker exited: {worker.stderr.read()}"
            assert time.monotonic() < deadline, "the worker did not listen within 90 s"
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        pre_stop = cmd.prestop_command(spec, "decode")
        assert pre_stop[:4] == ["pdserve", "drain", "--endpoint", f"127.0.0.1:{cmd.WORKER_PORT}"]
        pre_stop[3] = f"127.0.0.1:{port}"
        drained = subprocess.run(
            [sys.executable, "-m", *pre_stop, "--json"], capture_output=True, text=True, timeout=60, env=env
        )
        assert drained.returncode == 0, drained.stderr
        assert json.loads(drained.stdout) == {"endpoint": f"127.0.0.1:{port}", "in_flight": 0, "remaining": 0}
        assert worker.wait(30) == 0  # the drained worker left the registry and exited by itself
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
