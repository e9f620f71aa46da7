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


def test_a_secured_pools_args_file_starts_a_worker_that_only_the_prestop_drains(
    secure_etcd, checkpoints, tmp_path: Path
) -> None:
    # spec.clusterTLS and spec.etcd's TLS and user, as the pod has them: the Secrets' files
    # (here under tmp_path instead of /etc/pdserve) and the etcd user in the env.
    from tests.utils.certs import CertificateAuthority

    path, _ = checkpoints("llama")
    spec = parse_spec(
        {
            "spec": {
                "model": {"path": str(path), "name": "org/secured-pod"},
                "image": "pdserve:test",
                "decode": {"engineArgs": {"kvCacheMemory": "16M", "numThreads": 1, "drainTimeout": "20s"}},
                "clusterTLS": {"secretName": "cluster"},
                "etcd": {
                    "endpoints": [secure_etcd.url],
                    "tls": {"secretName": "etcd-tls", "clientCertificate": True},
                    "auth": {"secretName": "etcd-auth"},
                },
            }
        }
    )
    cluster = CertificateAuthority(tmp_path, "cluster").cluster_tls("pdserve-worker")
    client = secure_etcd.client
    files = {
        cmd.CLUSTER_TLS_DIR: {"ca.crt": cluster.ca, "tls.crt": cluster.cert, "tls.key": cluster.key},
        cmd.ETCD_TLS_DIR: {"ca.crt": client.ca, "tls.crt": client.cert, "tls.key": client.key},
    }
    for directory, names in files.items():
        (tmp_path / directory.lstrip("/")).mkdir(parents=True)
        for name, source in names.items():
            (tmp_path / directory.lstrip("/") / name).write_bytes(Path(source).read_bytes())

    def rooted(argv: list[str]) -> list[str]:
        return [f"{tmp_path}{arg}" if arg.startswith("/etc/pdserve/") else arg for arg in argv]

    args_file = tmp_path / "decode.args"
    args_file.write_text(cmd.args_file(rooted(cmd.worker_args(spec, "decode", secure_etcd.url))))
    port = _free_port()
    pod_args = ["--worker-id", "decode-secured-0", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env |= {"PDSERVE_ETCD_USER": "pdserve-worker", "PDSERVE_ETCD_PASSWORD": "unused-w"}
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
        pre_stop = rooted(cmd.prestop_command(spec, "decode"))
        pre_stop[3] = f"127.0.0.1:{port}"
        # Without the cluster certificate the worker's mTLS refuses the drain...
        plain = pre_stop[: pre_stop.index("--cluster-ca")]
        refused = subprocess.run([sys.executable, "-m", *plain], capture_output=True, text=True, timeout=60, env=env)
        assert refused.returncode == 1 and worker.poll() is None, refused.stderr
        # ... and with it, as the pod's preStop runs, the worker drains and exits.
        drained = subprocess.run(
            [sys.executable, "-m", *pre_stop, "--json"], capture_output=True, text=True, timeout=60, env=env
        )
        assert drained.returncode == 0, drained.stderr
        assert json.loads(drained.stdout) == {"endpoint": f"127.0.0.1:{port}", "in_flight": 0, "remaining": 0}
        assert worker.wait(30) == 0, worker.stderr.read()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
