"""The operator commands against an etcd with TLS client certificates and auth (``secure_etcd``):
they work with the operator's credentials, and fail clearly without them; and ``drain`` of a
real worker that has an admin key."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import msgspec
import pytest

from pdserve.cli import build_parser
from pdserve.cli.frontend_args import frontend_config
from pdserve.cli.serve import worker_config
from pdserve.discovery.etcd import close_quietly, connect
from pdserve.discovery.etcd_auth import EtcdAuth
from pdserve.discovery.registry import list_workers
from pdserve.environment import ETCD_AUTH_SETTINGS
from pdserve.frontend.config import FrontendConfig
from pdserve.rpc.tls import ClientTLS, ServerTLS
from tests.conftest import OPERATOR_PASSWORD, SecureEtcd
from tests.utils.aio import run_scenario
from tests.utils.certs import CertificateAuthority


def pdserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m pdserve ARGS``, with no $PDSERVE_ETCD* inherited, and ``env`` added."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_ETCD")}
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
    )


def tls_options(etcd: SecureEtcd, common_name: str | None = None) -> list[str]:
    tls = etcd.client if common_name is None else etcd.ca.client_tls(common_name)
    return ["--etcd", etcd.url, "--etcd-cacert", str(tls.ca), "--etcd-cert", str(tls.cert), "--etcd-key", str(tls.key)]


@pytest.mark.slow
def test_slo_and_knobs_set_work_with_the_operators_credentials(secure_etcd, model):
    operator = [*tls_options(secure_etcd), "--etcd-user", "operator"]
    password = {"PDSERVE_ETCD_PASSWORD": OPERATOR_PASSWORD}
    stored = pdserve(
        "slo", "set", "--model", model, "--ttft-p90", "400ms", "--itl-p90", "20ms", *operator, env=password
    )
    assert stored.returncode == 0, stored.stderr
    shown = pdserve("slo", "show", "--model", model, "--json", *operator, env=password)
    assert shown.returncode == 0 and model in shown.stdout, shown.stderr
    knobs = pdserve("knobs", "set", "--model", model, "--decode-max-num-seqs", "8", *operator, env=password)
    assert knobs.returncode == 0, knobs.stderr
    status = pdserve("status", "--model", model, "--json", *operator, env=password)
    assert status.returncode == 0 and model in status.stdout, status.stderr
    # The certificate and the user may come from the environment too.
    by_env = {
        "PDSERVE_ETCD": secure_etcd.url,
        "PDSERVE_ETCD_CACERT": secure_etcd.ca.ca,
        "PDSERVE_ETCD_CERT": secure_etcd.client.cert,
        "PDSERVE_ETCD_KEY": secure_etcd.client.key,
        "PDSERVE_ETCD_USER": "operator",
        **password,
    }
    drained = pdserve("drain", "no-such-worker", env=by_env)
    assert drained.returncode == 1 and "no worker 'no-such-worker' in the registry" in drained.stderr, drained.stderr


@pytest.mark.slow
def test_without_credentials_the_commands_fail_naming_what_is_missing(secure_etcd, model):
    slo = ["slo", "set", "--model", model, "--ttft-p90", "400ms", "--itl-p90", "20ms"]
    no_user = pdserve(*slo, *tls_options(secure_etcd))
    assert no_user.returncode == 1
    assert f"error: etcd at {secure_etcd.url} refused the request: etcdserver: permission denied" in no_user.stderr
    assert "--etcd-user" in no_user.stderr
    wrong = pdserve(*slo, *tls_options(secure_etcd), "--etcd-user", "operator", env={"PDSERVE_ETCD_PASSWORD": "no"})
    assert wrong.returncode == 1 and "authentication failed" in wrong.stderr, wrong.stderr
    no_tls = pdserve(
        *slo, "--etcd", secure_etcd.url, "--etcd-user", "operator", env={"PDSERVE_ETCD_PASSWORD": OPERATOR_PASSWORD}
    )
    assert no_tls.returncode == 1 and "TLS failed" in no_tls.stderr and "--etcd-cacert" in no_tls.stderr
    # A worker's certificate is known to etcd, but its role grants no SLO writes.
    as_worker = pdserve(*slo, *tls_options(secure_etcd, "pdserve-worker"))
    assert as_worker.returncode == 1 and "permission denied" in as_worker.stderr, as_worker.stderr
    missing = pdserve(*slo, "--etcd", secure_etcd.url, "--etcd-cacert", "/nonexistent/ca.pem")
    assert missing.returncode == 2 and "TLS CA /nonexistent/ca.pem: No such file" in missing.stderr
    password_only = pdserve(*slo, *tls_options(secure_etcd), "--etcd-password", "x")
    assert password_only.returncode == 2 and "both a user and a password" in password_only.stderr


@pytest.mark.slow
def test_a_worker_with_an_admin_key_drains_only_for_it(etcd_url, model, checkpoints):
    path, _ = checkpoints("llama")
    worker_id = f"decode-{model[-8:]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve",
            "decode",
            "--model",
            str(path),
            "--model-name",
            model,
            "--etcd",
            etcd_url,
            "--worker-id",
            worker_id,
            "--num-threads",
            "1",
            "--kv-cache-memory",
            "16M",
        ],
        env={**env, "PDSERVE_ADMIN_KEY": "drain-key"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        run_scenario(wait_registered(etcd_url, worker_id, process))
        drain = ["drain", worker_id, "--etcd", etcd_url, "--wait", "--timeout", "30s"]
        anonymous = pdserve(*drain)
        assert anonymous.returncode == 1 and "UNAUTHENTICATED: Drain needs the admin key" in anonymous.stderr
        wrong = pdserve(*drain, "--admin-key", "guess")
        assert wrong.returncode == 1 and "PERMISSION_DENIED: Drain: wrong admin key" in wrong.stderr
        assert process.poll() is None, "a refused Drain stopped the worker"
        allowed = pdserve(*drain, env={"PDSERVE_ADMIN_KEY": "drain-key"})
        assert allowed.returncode == 0, allowed.stderr
        assert f"{worker_id} has left the registry" in allowed.stdout
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def wait_registered(etcd_url: str, worker_id: str, process: subprocess.Popen) -> None:
    client = await connect(etcd_url)
    try:
        deadline = time.monotonic() + 60
        while not any(w.worker_id == worker_id for w in await list_workers(client)):
            assert process.poll() is None, f"the worker exited: {process.stderr.read()}"
            assert time.monotonic() < deadline, "the worker did not register within 60 s"
            await asyncio.sleep(0.2)
    finally:
        await close_quietly(client)


def test_the_security_options_fill_the_configs_with_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PDSERVE_ADMIN_KEY", raising=False)
    for name in ETCD_AUTH_SETTINGS:
        monkeypatch.delenv(f"PDSERVE_{name.upper()}", raising=False)
    ca = CertificateAuthority(tmp_path, "c")
    member = ca.cluster_tls("m")
    cluster = ["--cluster-ca", "c-ca.pem", "--cluster-cert", "c-m.pem", "--cluster-key", "c-m-key.pem"]
    etcd = ["--etcd", "https://e:2379", "--etcd-cacert", "c-ca.pem", "--etcd-user", "u", "--etcd-password", "p"]
    worker = worker_config(build_parser().parse_args(["decode", "--model", "/m", *cluster, *etcd, "--admin-key", "k"]))
    assert worker.cluster_tls == member and worker.admin_key == "k"
    assert worker.etcd_auth == EtcdAuth(tls=ClientTLS(ca=ca.ca), user="u", password="p")
    api = ca.server_tls("api")
    frontend = frontend_config(
        build_parser().parse_args(
            [
                "frontend",
                "--tls-cert",
                "c-api.pem",
                "--tls-key",
                "c-api-key.pem",
                "--tls-client-ca",
                "c-ca.pem",
                *cluster,
            ]
        ),
        "http://e",
    )
    assert frontend.tls == ServerTLS(cert=api.cert, key=api.key, client_ca=ca.ca) and frontend.cluster_tls == member


@pytest.mark.slow
def test_bad_security_options_fail_before_anything_starts(tmp_path):
    ca = CertificateAuthority(tmp_path, "c")
    api = ca.server_tls("api")
    half = pdserve("frontend", "--etcd", "http://e", "--tls-cert", api.cert)
    assert half.returncode == 2 and "needs both --tls-cert and --tls-key" in half.stderr
    partial = pdserve("decode", "--model", "/m", "--etcd", "http://e", "--cluster-ca", ca.ca)
    assert partial.returncode == 2 and "missing --cluster-cert, --cluster-key" in partial.stderr
    mismatched = pdserve("frontend", "--etcd", "http://e", "--tls-cert", api.cert, "--tls-key", ca.issue("x").key)
    assert mismatched.returncode == 2 and "are not a certificate and its key" in mismatched.stderr
    config = tmp_path / "frontend.json"
    config.write_bytes(msgspec.json.encode(FrontendConfig(etcd="http://e")))
    beside = pdserve("frontend", "--config", str(config), "--tls-cert", api.cert, "--etcd-user", "u")
    assert beside.returncode == 2 and "set tls_cert, etcd_user in it" in beside.stderr
    embedded = pdserve("up", "--model", str(tmp_path), "--etcd-user", "u", "--etcd-password", "p")
    assert embedded.returncode == 2 and "the embedded registry takes the cluster's certificates" in embedded.stderr
    member = ca.cluster_tls("m")
    both = pdserve(
        "up",
        "--model",
        str(tmp_path),
        "--insecure",
        "--cluster-ca",
        ca.ca,
        "--cluster-cert",
        member.cert,
        "--cluster-key",
        member.key,
    )
    assert both.returncode == 2 and "--insecure and --cluster-ca" in both.stderr
    plain_url = pdserve("workers", "--etcd", "http://e:2379", "--etcd-cacert", ca.ca)
    assert plain_url.returncode == 2 and "need an https:// URL" in plain_url.stderr
