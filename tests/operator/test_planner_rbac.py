"""A planner's access, end to end on the real API server, under the chart's own RBAC: the
operator (as the chart's service account, cluster-wide or watching one namespace) makes the
planner's ServiceAccount and RoleBinding, and a client holding that ServiceAccount's token
scales its PDServeDeployment and can do nothing else."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from pdserve.operator.kube import Kube, object_path
from pdserve.operator.reconcile import Settings, reconcile
from pdserve.planner.scaling import KubernetesConnector
from tests.operator.conftest import CHART
from tests.operator.test_chart import render
from tests.utils.kube_server import KubeServer

pytestmark = pytest.mark.slow

RBAC = "/apis/rbac.authorization.k8s.io/v1"
# Where each of the chart's kinds that grant access is created.
COLLECTIONS = {
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "ClusterRole": f"{RBAC}/clusterroles",
    "ClusterRoleBinding": f"{RBAC}/clusterrolebindings",
    "RoleBinding": RBAC + "/namespaces/{ns}/rolebindings",
}


def create_namespace(kube: Kube) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.request(
        "POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    )
    return name


def token(kube: Kube, namespace: str, account: str) -> str:
    """A token of ``namespace/account``, as its pod would hold it."""
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}}
    path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token"
    return kube.request("POST", path, body=request)["status"]["token"]


def resource(kube: Kube, namespace: str, planner: dict[str, Any]) -> str:
    body = yaml.safe_load((CHART / "examples" / "llama-small.yaml").read_text())
    body["metadata"]["namespace"] = namespace
    body["spec"]["planner"] = planner
    return kube.request("POST", object_path("PDServeDeployment", namespace), body=body)["metadata"]["name"]


@pytest.fixture(params=["cluster-wide", "one-namespace"])
def chart_rbac(request: pytest.FixtureRequest, kube: Kube, namespace: str) -> Iterator[tuple[str, str]]:
    """The chart's RBAC, rendered for a release in a namespace of its own and created (the
    deployment's namespace is the one it watches): the release's name and namespace."""
    release, release_ns = f"pr-{uuid.uuid4().hex[:6]}", create_namespace(kube)
    values = ["--set", "etcd.enabled=false", "--set", "etcd.endpoint=http://etcd:2379"]
    if request.param == "one-namespace":
        values += ["--set", f"operator.watchNamespace={namespace}"]
    docs = [d for d in render(*values, release=release, namespace=release_ns) if d["kind"] in COLLECTIONS]
    created = []
    for doc in docs:
        ns = doc["metadata"].get("namespace", release_ns)
        collection = COLLECTIONS[doc["kind"]].format(ns=ns)
        kube.request("POST", collection, body=doc)
        created.append(f"{collection}/{doc['metadata']['name']}")
    yield release, release_ns
    for path in created:
        kube.delete(path)
    kube.delete(f"/api/v1/namespaces/{release_ns}")


def connector(kube_server: KubeServer, bearer: str, name: str, namespace: str) -> KubernetesConnector:
    api = k8s.CustomObjectsApi(k8s.ApiClient(kube_server.configuration(bearer)))
    return KubernetesConnector(name, namespace, api=api)


def test_the_operator_binds_the_planner_to_scale_its_deployment_and_nothing_else(
    kube: Kube, kube_server: KubeServer, namespace: str, chart_rbac: tuple[str, str]
) -> None:
    release, release_ns = chart_rbac
    operator = Kube(kube_server.configuration(token(kube, release_ns, f"{release}-pdserve")))
    settings = Settings(
        default_etcd="http://etcd:2379", read_registry=False, planner_cluster_role=f"{release}-pdserve-planner"
    )
    name = resource(kube, namespace, {"enabled": True, "profileConfigMap": "profile"})
    try:
        status = asyncio.run(reconcile(operator, namespace, name, settings))  # a 403 raises here
        assert status is not None and not any(c["reason"] == "InvalidSpec" for c in status["conditions"])
        planner = f"{name}-planner"
        account = kube.get(object_path("ServiceAccount", namespace, planner))
        binding = kube.get(object_path("RoleBinding", namespace, planner))
        assert account is not None and binding is not None
        uid = kube.get(object_path("PDServeDeployment", namespace, name))["metadata"]["uid"]
        for obj in (account, binding):
            assert [o["uid"] for o in obj["metadata"]["ownerReferences"]] == [uid]
        assert binding["roleRef"]["name"] == f"{release}-pdserve-planner"
        pod = kube.get(object_path("Deployment", namespace, planner))["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == planner

        # The planner, with its own token: it reads and scales its deployment...
        bearer = token(kube, namespace, planner)
        own = connector(kube_server, bearer, name, namespace)

        async def scale() -> tuple[int, int]:
            await own.scale(3, 4)
            return await own.current()

        assert asyncio.run(scale()) == (3, 4)
        # ... and neither a deployment of another namespace nor a delete of its own.
        other = resource(kube, release_ns, {"enabled": False})
        with pytest.raises(ApiException) as refused:
            asyncio.run(connector(kube_server, bearer, other, release_ns).scale(5, 5))
        assert refused.value.status == 403
        with pytest.raises(ApiException) as refused:
            own._client().delete_namespaced_custom_object(
                "pdserve.io", "v1alpha1", namespace, "pdservedeployments", name
            )
        assert refused.value.status == 403
        assert kube.get(object_path("PDServeDeployment", release_ns, other))["spec"]["decode"]["replicas"] == 2

        # A planner turned off takes its access with it.
        kube.merge_patch(object_path("PDServeDeployment", namespace, name), {"spec": {"planner": {"enabled": False}}})
        asyncio.run(reconcile(operator, namespace, name, settings))
        assert kube.get(object_path("ServiceAccount", namespace, planner)) is None
        assert kube.get(object_path("RoleBinding", namespace, planner)) is None
    finally:
        operator.close()
