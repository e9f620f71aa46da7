"""The whole disaggregated path secured: the public API over mTLS, frontend-to-worker calls over
the cluster's mTLS, and a registry (real etcd) that requires TLS client certificates and runs
etcd's auth, each component known by its certificate's common name (README: Security).

One deployment (1 prefill + 1 decode worker of a tiny Llama and a frontend, real processes,
real NIXL) is shared by the tests here; the last one drains its decode worker.
"""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys

import grpc
import httpx2
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import LLM, SamplingParams
from pdserve.rpc.tls import ClientTLS
from pdserve.v1 import inference_pb2, inference_pb2_grpc
from tests.conftest import OPERATOR_PASSWORD
from tests.e2e.deployment import Deployment, UpProcess
from tests.utils.certs import CertificateAuthority

pytestmark = pytest.mark.slow
MODEL = "e2e-mtls"
PROMPT = list(range(5, 40))


@pytest.fixture(scope="module")
def secured(checkpoints, secure_etcd, tmp_path_factory):
    directory = tmp_path_factory.mktemp("mtls")
    cluster, public, other = (CertificateAuthority(directory, name) for name in ("cluster", "public", "other"))
    api_client = public.client_tls("api-user")
    deployment = Deployment(
        str(checkpoints("llama")[0]),
        secure_etcd.url,
        prefill=1,
        decode=1,
        model_name=MODEL,
        disaggregation="always",
        worker_fields={"cluster_tls": cluster.cluster_tls("worker"), "etcd_auth": secure_etcd.auth("pdserve-worker")},
        frontend_fields={
            "cluster_tls": cluster.cluster_tls("frontend"),
            "tls": public.server_tls(client_ca=public.ca),
            "etcd_auth": secure_etcd.auth("pdserve-frontend"),
        },
        client_tls=api_client,
        etcd_auth=secure_etcd.auth(user="operator", password=OPERATOR_PASSWORD),
    )
    yield deployment, cluster, public, other, api_client
    deployment.close()


def _generate(port: int, tls: ClientTLS | None, model: str = MODEL) -> grpc.StatusCode:
    """The status of one small Generate of ``model`` ("": the only one) on the public API at ``port``."""
    target = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(target) if tls is None else grpc.secure_channel(target, tls.grpc_credentials())
    request = inference_pb2.GenerateRequest(
        model=model, token_ids=inference_pb2.TokenIds(ids=PROMPT), sampling=inference_pb2.SamplingOptions(max_tokens=2)
    )
    with channel:
        try:
            list(inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=30))
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def test_greedy_tokens_over_the_disaggregated_path_under_mtls_equal_the_offline_engine(secured, checkpoints):
    deployment, *_ = secured
    want = LLM(str(checkpoints("llama")[0])).generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )[0]
    result = deployment.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert result["token_ids"] == want.token_ids
    b = result["final"].breakdown
    assert b.disaggregated and b.prefill_worker.startswith("prefill-") and b.decode_worker.startswith("decode-")
    assert b.kv_transfer_bytes > 0


def test_the_public_api_refuses_clients_without_a_certificate_of_its_ca(secured):
    deployment, cluster, public, other, api_client = secured
    assert _generate(deployment.port, api_client) == grpc.StatusCode.OK
    assert _generate(deployment.port, ClientTLS(ca=public.ca)) == grpc.StatusCode.UNAVAILABLE
    assert _generate(deployment.port, other.client_tls("stranger", ca=public.ca)) == grpc.StatusCode.UNAVAILABLE
    # A cluster certificate is no API client certificate: the API trusts its own CA only.
    assert _generate(deployment.port, cluster.client_tls("frontend-2", ca=public.ca)) == grpc.StatusCode.UNAVAILABLE
    assert _generate(deployment.port, None) == grpc.StatusCode.UNAVAILABLE


def test_the_openai_api_is_https_only_and_needs_a_client_certificate_of_its_ca(secured):
    deployment, _, public, other, api_client = secured
    assert deployment.http_url.startswith("https://127.0.0.1:")

    def client(cert: tuple[str, str] | None) -> openai.OpenAI:
        context = ssl.create_default_context(cafile=public.ca)
        if cert is not None:
            context.load_cert_chain(*cert)
        return openai.OpenAI(
            base_url=deployment.http_url,
            api_key="unused",
            max_retries=0,
            timeout=30,
            http_client=httpx2.Client(verify=context),
        )

    got = client((api_client.cert, api_client.key)).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert got.usage.completion_tokens == 2
    stranger = other.client_tls("stranger-http", ca=public.ca)
    for cert in (None, (stranger.cert, stranger.key)):
        with pytest.raises(openai.APIConnectionError):
            client(cert).models.list()
    with pytest.raises(httpx2.HTTPError):  # plain HTTP on the TLS port
        httpx2.get(deployment.http_url.replace("https://", "http://") + "/models", timeout=10)


def test_workers_serve_only_cluster_members(secured):
    deployment, cluster, public, *_ = secured
    endpoints = [w.endpoint for w in deployment.registered()]
    assert len(endpoints) == 2

    def check(endpoint: str, tls: ClientTLS) -> grpc.StatusCode:
        options = tls.grpc_options()
        with grpc.secure_channel(endpoint, tls.grpc_credentials(), options=options) as channel:
            try:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            except grpc.RpcError as error:
                return error.code()
        return grpc.StatusCode.OK

    member = cluster.cluster_tls("operator").client
    anonymous = ClientTLS(ca=cluster.ca, server_name=member.server_name)
    api_user = public.client_tls("api-user-2", ca=cluster.ca)  # a certificate of another CA
    api_user = ClientTLS(ca=api_user.ca, cert=api_user.cert, key=api_user.key, server_name=member.server_name)
    for endpoint in endpoints:
        assert check(endpoint, member) == grpc.StatusCode.OK
        assert check(endpoint, anonymous) == grpc.StatusCode.UNAVAILABLE
        assert check(endpoint, api_user) == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(endpoint) as channel:
            with pytest.raises(grpc.RpcError) as error:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def test_generate_cli_speaks_mtls_to_the_frontend(secured):
    deployment, _, public, _, api_client = secured
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "generate",
        "--target",
        f"127.0.0.1:{deployment.port}",
        "--token-ids",
        ",".join(map(str, PROMPT)),
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        "--json",
    ]
    result = subprocess.run(
        [*argv, "--tls-ca", public.ca, "--tls-cert", str(api_client.cert), "--tls-key", str(api_client.key)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["breakdown"]["kv_transfer_bytes"] > 0
    refused = subprocess.run([*argv, "--tls-ca", public.ca], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr


def test_drain_needs_a_cluster_certificate(secured, secure_etcd):
    deployment, cluster, *_ = secured
    decode = next(w for w in deployment.registered() if w.role == "decode")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env["PDSERVE_ETCD_PASSWORD"] = OPERATOR_PASSWORD
    etcd = [
        "--etcd",
        secure_etcd.url,
        "--etcd-cacert",
        secure_etcd.ca.ca,
        "--etcd-cert",
        secure_etcd.client.cert,
        "--etcd-key",
        secure_etcd.client.key,
        "--etcd-user",
        "operator",
    ]
    drain = [sys.executable, "-m", "pdserve", "drain", decode.worker_id, *etcd, "--wait", "--timeout", "30s"]
    refused = subprocess.run(drain, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 1 and f"Drain RPC to {decode.worker_id}" in refused.stderr, refused.stderr
    assert "needs --cluster-ca, --cluster-cert and --cluster-key" in refused.stderr
    operator = cluster.cluster_tls("operator")
    allowed = subprocess.run(
        [*drain, "--cluster-ca", operator.ca, "--cluster-cert", operator.cert, "--cluster-key", operator.key],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert allowed.returncode == 0, allowed.stderr
    assert f"{decode.worker_id} has left the registry" in allowed.stdout


def test_up_with_cluster_certificates_serves_its_embedded_registry_over_mtls_too(checkpoints, tmp_path):
    ca, public = CertificateAuthority(tmp_path, "cluster"), CertificateAuthority(tmp_path, "public")
    node, api = ca.cluster_tls("node"), public.server_tls("api")
    up = UpProcess(
        "up",
        "--model",
        str(checkpoints("llama")[0]),
        "--port",
        "0",
        "--http-port",
        "0",
        "--disaggregation",
        "always",
        "--threads-per-worker",
        "1",
        "--cluster-ca",
        node.ca,
        "--cluster-cert",
        node.cert,
        "--cluster-key",
        node.key,
        "--tls-cert",
        api.cert,
        "--tls-key",
        api.key,
    )
    try:
        up_line, port = up.wait_up()
        registry = re.search(r"registry (\S+) \(embedded\)", up_line).group(1)
        assert registry.startswith("https://127.0.0.1:")
        workers = [sys.executable, "-m", "pdserve", "workers", "--etcd", registry, "--json"]
        plain = subprocess.run([*workers, "--etcd-cacert", ca.ca], capture_output=True, text=True, timeout=60)
        assert plain.returncode == 1 and "TLS failed" in plain.stderr, plain.stderr
        # An operator with a cluster certificate, checking the registry's for the cluster's name.
        operator = ca.cluster_tls("operator")
        member = subprocess.run(
            [*workers, "--etcd-server-name", "pdserve-cluster"],
            capture_output=True,
            text=True,
            timeout=60,
            env={
                **os.environ,
                "PDSERVE_ETCD_CACERT": ca.ca,
                "PDSERVE_ETCD_CERT": operator.cert,
                "PDSERVE_ETCD_KEY": operator.key,
            },
        )
        assert member.returncode == 0, member.stderr
        assert sorted(w["role"] for w in json.loads(member.stdout)) == ["decode", "prefill"]
        assert _generate(port, ClientTLS(ca=public.ca), model="") == grpc.StatusCode.OK
        up.process.send_signal(signal.SIGINT)
        assert up.process.wait(60) == 0, up.output
    finally:
        up.close()
