"""Import budgets: the commands that only talk to servers load no torch, no Triton and no NIXL,
and importing pdserve's light packages loads none of them either and leaves the environment as
it was.

Each command runs as a user runs it, ``python -m pdserve ...`` in a fresh interpreter, against
real servers (etcd; a gRPC server that answers ``Generate``) or a closed port, and at exit the
interpreter prints which of the heavy packages it ever imported.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from pdserve.v1 import inference_pb2, inference_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "triton", "nixl", "nixl_cu12")
# Runs the pdserve command line in a fresh interpreter; at exit, whatever the command did,
# prints the heavy packages that were imported.
RUN_CLI = f"""
import atexit, json, sys
atexit.register(lambda: print("HEAVY-IMPORTS", json.dumps(sorted({{name.split(".")[0] for name in sys.modules}}
                                                             & set({HEAVY!r}))), file=sys.stderr))
from pdserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def heavy_imports(stderr: str) -> list[str]:
    lines = [line for line in stderr.splitlines() if line.startswith("HEAVY-IMPORTS ")]
    assert lines, f"the command's interpreter did not report at exit:\n{stderr}"
    return json.loads(lines[-1].removeprefix("HEAVY-IMPORTS "))


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    return subprocess.run(
        [sys.executable, "-c", RUN_CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


class _Inference(inference_pb2_grpc.InferenceServicer):
    """Answers every Generate with one token and a final message."""

    def Generate(self, request, context):
        yield inference_pb2.GenerateResponse(
            token_ids=[7], text="x", final=inference_pb2.Final(finish_reason="length", text="x")
        )


@pytest.fixture(scope="module")
def inference_target() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    inference_pb2_grpc.add_InferenceServicer_to_server(_Inference(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_generate_against_a_server_loads_no_torch(inference_target: str) -> None:
    result = run_cli("generate", "--target", inference_target, "--token-ids", "1,2,3", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["token_ids"] == [7]
    assert heavy_imports(result.stderr) == []


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["top", "--once"],
        ["workers"],
        ["slo", "show"],
        ["knobs", "show"],
        ["slo", "set", "--model", "budget", "--ttft-p90", "500ms", "--itl-p90", "30ms"],
        ["knobs", "set", "--model", "budget", "--decode-max-num-seqs", "8"],
    ],
)
def test_etcd_commands_load_no_torch(command: list[str], etcd_url: str) -> None:
    result = run_cli(*command, "--etcd", etcd_url)
    assert result.returncode == 0, result.stderr
    assert heavy_imports(result.stderr) == []


def test_drain_loads_no_torch() -> None:
    result = run_cli("drain", "--endpoint", f"127.0.0.1:{free_port()}")
    assert result.returncode == 1, result.stderr  # nothing listens there
    assert heavy_imports(result.stderr) == []


def unreachable_kubeconfig(tmp_path: Path) -> Path:
    """A kubeconfig naming an API server that is not there."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "k", "cluster": {"server": f"http://127.0.0.1:{free_port()}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
            }
        )
    )
    return kubeconfig


def test_remove_deployments_loads_no_torch(tmp_path: Path) -> None:
    # With no API server it retries each call until its deadline, then fails.
    result = run_cli("remove-deployments", "--kubeconfig", str(unreachable_kubeconfig(tmp_path)), "--timeout", "2s")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "API call failed, retrying" in result.stdout
    assert "pdserve remove-deployments: error: after 2 s, the API server never answered" in result.stderr
    assert heavy_imports(result.stderr) == []


@pytest.mark.slow
def test_operator_loads_no_torch(tmp_path: Path) -> None:
    # An API server that is not there: the operator starts its handlers and keeps retrying.
    kubeconfig = unreachable_kubeconfig(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            RUN_CLI,
            "operator",
            "--kubeconfig",
            str(kubeconfig),
            "--metrics-port",
            "-1",
            "--health-port",
            "-1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        time.sleep(8)  # past start-up: its handlers are loaded and it is reaching for the API server
        assert process.poll() is None, process.communicate()[1]
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert heavy_imports(stderr) == []


@pytest.mark.parametrize(
    "module",
    [
        "pdserve",
        "pdserve.cli",
        "pdserve.types.engine_config",
        "pdserve.types.sampling_params",
        "pdserve.distributed.parallel_config",
        "pdserve.distributed.errors",
        "pdserve.kernels",
    ],
)
def test_light_modules_load_nothing_heavy_and_change_no_environment(module: str) -> None:
    code = (
        "import json, os, sys\n"
        "before = dict(os.environ)\n"
        f"import {module}\n"
        f"heavy = sorted({{name.split('.')[0] for name in sys.modules}} & set({HEAVY!r}))\n"
        "changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))\n"
        "print(json.dumps([heavy, changed]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [[], []]
