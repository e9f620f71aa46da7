"""charts/pdserve/examples/secured.yaml on the real API server, against a real etcd with TLS,
client-certificate auth and users: the CRD keeps every field, and the operator, under the
chart's own RBAC, reads the deployment's etcd with the Secrets it names and counts the
workers registered there."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.operator.kube import Kube, object_path
from pdserve.operator.reconcile import Settings, reconcile
from tests.conftest import OPERATOR_PASSWORD, SecureEtcd
from tests.operator.conftest import CHART, delete_key, put_worker
from tests.operator.test_operator import pruned
from tests.operator.test_planner_rbac import chart_rbac, token  # noqa: F401 (chart_rbac: a fixture)
from tests.utils.kube_server import KubeServer

pytestmark = pytest.mark.slow


def secret(kube: Kube, namespace: str, name: str, data: dict[str, bytes]) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace},
        "data": {key: base64.b64encode(value).decode() for key, value in data.items()},
    }
    kube.request("POST", object_path("Secret", namespace), body=body)


def problem(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "Degraded")


def test_the_operator_counts_the_workers_of_a_secured_etcd_with_the_deployments_secrets(
    kube: Kube,
    kube_server: KubeServer,
    namespace: str,
    chart_rbac: tuple[str, str],  # noqa: F811
    secure_etcd: SecureEtcd,
) -> None:
    release, release_ns = chart_rbac
    body = yaml.safe_load((CHART / "examples" / "secured.yaml").read_text())
    body["metadata"]["namespace"] = namespace
    body["spec"]["etcd"]["endpoints"] = [secure_etcd.url]
    created = kube.request("POST", object_path("PDServeDeployment", namespace), body=body)
    assert pruned(body["spec"], created["spec"]) == [], "fields the CRD does not know"
    name = created["metadata"]["name"]

    operator = Kube(kube_server.configuration(token(kube, release_ns, f"{release}-pdserve")))
    settings = Settings(read_registry=True, planner_cluster_role=f"{release}-pdserve-planner")
    worker = secure_etcd.auth("pdserve-worker")  # the worker's user: its certificate's name
    key = asyncio.run(put_worker(secure_etcd.url, "SmolLM2-135M-Instruct", f"decode-{namespace}", auth=worker))
    try:
        # Without its Secrets the registry stays unread, and the status names the field.
        status = asyncio.run(reconcile(operator, namespace, name, settings))
        assert status is not None and problem(status)["reason"] == "RegistryUnreachable"
        assert "spec.etcd.tls.secretName" in problem(status)["message"]
        assert kube.get(object_path("Deployment", namespace, f"{name}-decode")) is not None

        client = secure_etcd.client  # a certificate of a name no etcd user has: the password decides
        assert client.ca is not None and client.cert is not None and client.key is not None
        files = {"ca.crt": client.ca, "tls.crt": client.cert, "tls.key": client.key}
        secret(kube, namespace, "secured-etcd-tls", {k: Path(v).read_bytes() for k, v in files.items()})
        secret(kube, namespace, "secured-etcd-auth", {"username": b"operator", "password": b"wrong"})
        status = asyncio.run(reconcile(operator, namespace, name, settings))
        assert status is not None and problem(status)["reason"] == "RegistryUnreachable", status
        assert "wrong" not in problem(status)["message"]

        kube.merge_patch(
            object_path("Secret", namespace, "secured-etcd-auth"),
            {"data": {"password": base64.b64encode(OPERATOR_PASSWORD.encode()).decode()}},
        )
        status = asyncio.run(reconcile(operator, namespace, name, settings))
        assert status is not None and problem(status)["status"] == "False", problem(status)
        assert status["decode"]["registered"] == 1
        assert status["endpoints"]["openai"].startswith("https://")
    finally:
        asyncio.run(delete_key(secure_etcd.url, key, auth=worker))
        operator.close()
