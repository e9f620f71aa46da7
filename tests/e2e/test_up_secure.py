"""``pdserve up`` is secure by default: with no certificates given it makes its own, its worker
RPCs and embedded registry take only the deployment's own components, the commands run beside
it find their credentials, and the public API serves as before; ``--insecure`` is the old way."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import grpc
import pytest

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.deployment import UpProcess, etcdctl, recorded_deployment

pytestmark = pytest.mark.slow


def _up(path, tmp_path, *args: str) -> UpProcess:
    return UpProcess(
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
        *args,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )


def _pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    """A command run beside ``up`` with no etcd or TLS option, nor any such variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_ETCD")}
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=60, env=env)


def _prefill(endpoint: str, credentials: grpc.ChannelCredentials | None) -> grpc.RpcError | None:
    request = worker_pb2.PrefillRequest(request_id="intruder", prompt_token_ids=list(range(4, 400)))
    options = [("grpc.ssl_target_name_override", "pdserve-cluster")]
    with (
        grpc.secure_channel(endpoint, credentials, options=options) if credentials else grpc.insecure_channel(endpoint)
    ) as channel:
        try:
            worker_pb2_grpc.WorkerStub(channel).Prefill(request, timeout=10)
        except grpc.RpcError as error:
            return error
    return None


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def test_up_without_certificates_makes_its_own_and_admits_only_its_components(checkpoints, tmp_path):
    path, _ = checkpoints("llama")
    up = _up(path, tmp_path)
    try:
        up_line, _ = up.wait_up()
        record = recorded_deployment()
        assert record.etcd.startswith("https://") and record.cluster_tls is not None
        assert record.cluster_tls.cert.endswith("pdserve-tools.pem")
        assert oct(os.stat(os.path.dirname(record.cluster_tls.key)).st_mode & 0o777) == "0o700"

        # The commands beside it need no option.
        listed = _pdserve("workers", "--json")
        assert listed.returncode == 0, listed.stderr
        endpoints = {w["role"]: w["endpoint"] for w in json.loads(listed.stdout)}
        assert sorted(endpoints) == ["decode", "prefill"]
        status = _pdserve("status")
        assert status.returncode == 0 and path.name in status.stdout, status.stderr

        # The registry takes only the deployment's certificates.
        assert etcdctl("get", "--prefix", "--keys-only", "/pdserve").stdout.count("/pdserve/v1/workers/") == 2
        bare = etcdctl("get", "--prefix", "--keys-only", "/pdserve", certificates=False)
        assert bare.returncode != 0 and "/pdserve/v1/workers/" not in bare.stdout

        # A worker's port speaks no plaintext gRPC.
        plain = _prefill(endpoints["prefill"], None)
        assert plain is not None and plain.code() == grpc.StatusCode.UNAVAILABLE

        # The tools' certificate is the deployment's, but a Prefill is a frontend's call only.
        tools = record.cluster_tls
        credentials = grpc.ssl_channel_credentials(_read(tools.ca), _read(tools.key), _read(tools.cert))
        refused = _prefill(endpoints["prefill"], credentials)
        assert refused is not None and refused.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "Prefill is for pdserve-frontend only" in refused.details()
        assert "'pdserve-tools'" in refused.details()

        # The public API is not behind cluster mTLS.
        base_url = re.search(r"OpenAI API on (http://\S+/v1);", up_line).group(1)
        body = json.dumps({"model": path.name, "prompt": [4, 5, 6, 7], "max_tokens": 3, "temperature": 0})
        request = urllib.request.Request(
            f"{base_url}/completions", body.encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            completion = json.loads(answer.read())
        assert completion["usage"]["completion_tokens"] == 3

        # And the tools drain a worker with no option given.
        prefill_id = next(w["worker_id"] for w in json.loads(listed.stdout) if w["role"] == "prefill")
        drained = _pdserve("drain", prefill_id)
        assert drained.returncode == 0, drained.stderr

        up.process.send_signal(signal.SIGINT)
        assert up.process.wait(60) == 0, up.output
        assert not os.path.exists(os.path.join(os.environ["PDSERVE_STATE_DIR"], "deployment.json"))
        gone = _pdserve("workers")
        assert gone.returncode == 2 and "no `pdserve up` runs beside this command" in gone.stderr
    finally:
        up.close()


def test_up_insecure_serves_plaintext_as_before(checkpoints, tmp_path):
    path, _ = checkpoints("llama")
    up = _up(path, tmp_path, "--insecure", "--prefill", "0", "--disaggregation", "off")
    try:
        up.wait_up()
        record = recorded_deployment()
        assert record.etcd.startswith("http://") and record.cluster_tls is None
        assert (
            "/pdserve/v1/workers/" in etcdctl("get", "--prefix", "--keys-only", "/pdserve", certificates=False).stdout
        )
        listed = _pdserve("workers", "--json")
        assert listed.returncode == 0, listed.stderr
        assert "its Drain RPC is open to anyone" in up.output
        up.process.send_signal(signal.SIGINT)
        assert up.process.wait(60) == 0, up.output
    finally:
        up.close()
