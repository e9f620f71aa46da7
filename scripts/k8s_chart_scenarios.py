"""The scenarios of scripts/k8s_scenarios.py that act on the chart's release: a secured
deployment, ``helm uninstall``, and the chart again with a namespace-scoped operator.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from k8s_e2e import (
    PROMPT,
    Deployment,
    ScenarioFailed,
    Shared,
    get_json,
    kubectl,
    make_secured_secrets,
    processes_left,
    served_name,
    start,
    wait_for,
)

REPO = Path(__file__).resolve().parents[1]
SECURED = REPO / "charts" / "pdserve" / "examples" / "secured.yaml"
RELEASE = ["pdserve", "pdserve"]  # the chart's release and its namespace (--release, --release-namespace)
RELEASE_VALUES: dict[str, Any] = {}  # the values uninstall found, which namespaced installs again with


def grpc_status(target: str, cluster: Path, with_certificate: bool) -> str:
    """The status a call of a method no server has gets at ``target`` over the cluster's TLS:
    UNIMPLEMENTED means the connection was accepted."""
    import grpc

    ca = (cluster / "ca.crt").read_bytes()
    if with_certificate:
        creds = grpc.ssl_channel_credentials(ca, (cluster / "tls.key").read_bytes(), (cluster / "tls.crt").read_bytes())
    else:
        creds = grpc.ssl_channel_credentials(ca)
    with grpc.secure_channel(target, creds, options=[("grpc.ssl_target_name_override", "pdserve-cluster")]) as channel:
        try:
            channel.unary_unary("/pdserve.e2e.Nothing/Call")(b"", timeout=20)
        except grpc.RpcError as error:
            return error.code().name
    return "OK"


def secured(shared: Shared) -> dict[str, float]:
    """examples/secured.yaml on the chart's etcd (etcd over TLS with auth is checked against a
    real etcd in tests/operator/test_secured_operator.py): the API serves HTTPS to a client
    with the key and refuses one without; a worker accepts only cluster certificates."""
    from openai import AuthenticationError, DefaultHttpxClient, OpenAI

    deployment = Deployment(SECURED)
    deployment.body["spec"].pop("etcd", None)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            key, api_ca, cluster = make_secured_secrets(deployment.namespace, deployment.name, Path(tmp))
            started = time.monotonic()
            deployment.apply()
            status = wait_for(deployment.available, 900, "the secured deployment to be Available")
            base_url, model = status["endpoints"]["openai"], served_name(deployment)
            if not base_url.startswith("https://"):
                raise ScenarioFailed(f"a deployment with spec.tls gives {base_url}")
            http = DefaultHttpxClient(verify=str(api_ca))
            client = OpenAI(base_url=base_url, api_key=key, http_client=http, timeout=120, max_retries=0)

            def complete() -> str | None:
                try:
                    return client.completions.create(model=model, prompt=PROMPT, max_tokens=4).choices[0].text
                except Exception:
                    return None

            wait_for(complete, 300, "a completion with the API key")
            first_s = time.monotonic() - started
            stranger = OpenAI(base_url=base_url, api_key="not-the-key", http_client=http, max_retries=0)
            try:
                stranger.completions.create(model=model, prompt=PROMPT, max_tokens=4)
                raise ScenarioFailed("a request with a wrong API key was served")
            except AuthenticationError:
                pass
            target = f"{deployment.pods('decode')[0]['status']['podIP']}:50051"
            if grpc_status(target, cluster, with_certificate=True) != "UNIMPLEMENTED":
                raise ScenarioFailed(f"the decode worker at {target} refused the cluster certificate")
            if grpc_status(target, cluster, with_certificate=False) != "UNAVAILABLE":
                raise ScenarioFailed(f"the decode worker at {target} accepted a client without a certificate")
            return {"apply_to_first_completion_s": round(first_s, 1)}
    finally:
        deployment.close()


def uninstall(shared: Shared) -> dict[str, float]:
    """DESTRUCTIVE: ``helm uninstall`` of the chart's release (--release, --release-namespace)
    with the shared deployment serving: nothing of pdserve stays but the CRD."""
    deployment = shared.get()
    values = subprocess.run(
        ["helm", "get", "values", RELEASE[0], "-n", RELEASE[1], "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    RELEASE_VALUES.update(json.loads(values.stdout or "{}") or {})
    started = time.monotonic()
    done = subprocess.run(
        ["helm", "uninstall", RELEASE[0], "-n", RELEASE[1], "--wait", "--timeout", "5m"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    if done.returncode != 0:
        raise ScenarioFailed(f"helm uninstall: {done.stderr.strip()}")
    uninstall_s = time.monotonic() - started
    left = get_json("pdservedeployments", "-A")["items"]
    if left:
        raise ScenarioFailed(f"PDServeDeployments left: {[d['metadata']['name'] for d in left]}")
    selector = "app.kubernetes.io/name=pdserve"
    wait_for(lambda: not get_json("all", "-A", "-l", selector)["items"], 120, "every pdserve object to go")
    wait_for(lambda: not processes_left(), 60, "pdserve's processes to end")
    kubectl("delete", "namespace", deployment.namespace, "--wait=true", timeout_s=300)
    shared.deployment = None
    return {"uninstall_s": round(uninstall_s, 1)}


def namespaced(shared: Shared) -> dict[str, float]:
    """After uninstall: the chart again, its operator watching only its own namespace under
    namespace-scoped RBAC, with the values the uninstalled release had. The deployment in that
    namespace serves; one in another namespace is left alone; uninstall leaves nothing."""
    if not RELEASE_VALUES:
        raise ScenarioFailed("run uninstall first: namespaced installs the chart again with its values")
    namespace = f"pdserve-team-{uuid.uuid4().hex[:6]}"
    release = "pdserve-team"
    with tempfile.NamedTemporaryFile("w", suffix=".json") as values:
        json.dump(
            {**RELEASE_VALUES, "operator": {**RELEASE_VALUES.get("operator", {}), "watchNamespace": namespace}}, values
        )
        values.flush()
        helm(
            "install",
            release,
            str(REPO / "charts" / "pdserve"),
            "-n",
            namespace,
            "--create-namespace",
            "-f",
            values.name,
        )
    try:
        (operator,) = get_json("deployments", "-n", namespace, "-l", "app.kubernetes.io/component=operator")["items"]
        account = f"system:serviceaccount:{namespace}:{operator['spec']['template']['spec']['serviceAccountName']}"
        for where, expected in ((namespace, "yes"), ("default", "no")):
            answer = subprocess.run(
                ["kubectl", "auth", "can-i", "patch", "deployments.apps", f"--as={account}", "-n", where],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout.strip()
            if answer != expected:
                raise ScenarioFailed(
                    f"the operator may patch deployments in {where}: {answer!r}, expected {expected!r}"
                )
        started = time.monotonic()
        deployment, _base_url, _model = start(shared.example, namespace=namespace)
        serving_s = time.monotonic() - started
        outside = Deployment(shared.example)
        try:
            outside.apply()
            time.sleep(20)
            if outside.pods("decode") or outside.status():
                raise ScenarioFailed("the namespaced operator reconciled a deployment outside its namespace")
        finally:
            outside.close()
        deployment.close()
        helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "5m")
        wait_for(lambda: not get_json("pods", "-n", namespace)["items"], 120, "the namespace's pods to go")
        return {"apply_to_first_token_s": round(serving_s, 1)}
    finally:
        kubectl("delete", "namespace", namespace, "--wait=true", "--ignore-not-found", timeout_s=600)


def helm(*args: str) -> None:
    done = subprocess.run(["helm", *args], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise ScenarioFailed(f"helm {' '.join(args[:2])}: {done.stderr.strip()}")
