"""The Helm chart: lint, render over a values matrix (every manifest checked against the
Kubernetes schemas), refuse bad values naming them, install into the real API server, and run
the operator under the chart's own service account without a single 403."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pdserve.operator.kube import Kube, object_path
from tests.operator.conftest import CHART, delete_key, make_pods_ready, put_worker, wait_for
from tests.utils.kube_server import KubeServer, k8s_binary

# The oldest schemas kubernetes-validate ships; v1.20-only objects (policy/v1beta1) are
# checked by the real v1.20 server in the install test instead.
SCHEMA_VERSION = "1.25"
BUILTIN_GROUPS = {"v1", "apps/v1", "policy/v1", "rbac.authorization.k8s.io/v1"}

VALUES_MATRIX = {
    "defaults": [],
    "one-namespace": ["--set", "operator.watchNamespace=llm"],
    "external-etcd": ["--set", "etcd.enabled=false", "--set", "etcd.endpoint=http://etcd.infra:2379"],
    "etcd-persistent": ["--set", "etcd.persistence.enabled=true", "--set", "etcd.persistence.storageClassName=ssd"],
    "own-service-account": ["--set", "serviceAccount.create=false", "--set", "serviceAccount.name=ops"],
    "prometheus-and-policy-v1": [
        "--api-versions",
        "monitoring.coreos.com/v1/ServiceMonitor",
        "--api-versions",
        "policy/v1/PodDisruptionBudget",
    ],
}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([str(k8s_binary("helm")), *args], capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result


def render(*args: str, release: str = "rel", namespace: str = "pds") -> list[dict[str, Any]]:
    out = helm("template", release, str(CHART), "--namespace", namespace, *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def test_the_chart_lints_strictly() -> None:
    helm("lint", "--strict", str(CHART))


@pytest.mark.parametrize("case", VALUES_MATRIX)
def test_every_rendered_manifest_is_a_valid_kubernetes_object(case: str) -> None:
    docs = render(*VALUES_MATRIX[case])
    kinds = {doc["kind"] for doc in docs}
    assert {"Deployment", "ServiceAccount", "ClusterRole", "Service"} <= kinds or case == "own-service-account"
    for doc in docs:
        if doc["apiVersion"] in BUILTIN_GROUPS:
            kubernetes_validate.validate(doc, SCHEMA_VERSION, strict=True)
    has = lambda kind: any(d["kind"] == kind for d in docs)  # noqa: E731
    assert has("ServiceMonitor") == (case == "prometheus-and-policy-v1")  # gated on the API being served
    assert has("PodDisruptionBudget") == (case == "prometheus-and-policy-v1")  # helm template serves no policy API
    assert has("StatefulSet") == (case != "external-etcd")
    assert has("ServiceAccount") == (case != "own-service-account")
    operator = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in operator["containers"][0]["env"]}
    assert env["PDSERVE_ETCD"] == (
        "http://etcd.infra:2379" if case == "external-etcd" else "http://rel-pdserve-etcd.pds.svc:2379"
    )
    args = operator["containers"][0]["args"]
    assert ("--namespace=llm" in args) == (case == "one-namespace") and ("--all-namespaces" in args) != (
        case == "one-namespace"
    )
    # Planners: their ClusterRole holds what the connector calls and no more; the operator is
    # told its name, may bind it (and it alone), and makes and prunes the planners' accounts.
    roles = {d["metadata"]["name"]: d["rules"] for d in docs if d["kind"] == "ClusterRole"}
    assert roles["rel-pdserve-planner"] == [
        {"apiGroups": ["pdserve.io"], "resources": ["pdservedeployments"], "verbs": ["get", "patch"]}
    ]
    assert env["PDSERVE_PLANNER_CLUSTER_ROLE"] == "rel-pdserve-planner"
    granted = roles["rel-pdserve-operator"]
    assert {
        "apiGroups": ["rbac.authorization.k8s.io"],
        "resources": ["clusterroles"],
        "verbs": ["bind"],
        "resourceNames": ["rel-pdserve-planner"],
    } in granted
    for group, resource in (("", "serviceaccounts"), ("rbac.authorization.k8s.io", "rolebindings")):
        assert {
            "apiGroups": [group],
            "resources": [resource],
            "verbs": ["list", "create", "patch", "delete"],
        } in granted
    assert not any("escalate" in rule["verbs"] or "*" in rule["verbs"] for rules in roles.values() for rule in rules)
    binding = next(d for d in docs if d["metadata"]["name"] == "rel-pdserve-operator" and "roleRef" in d)
    assert binding["kind"] == ("RoleBinding" if case == "one-namespace" else "ClusterRoleBinding")


def containers(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind)["spec"]["template"]["spec"]["containers"][0]


def test_the_operator_runs_its_own_image_and_local_images_need_no_pull() -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    docs = render("--set", "image.repository=example.com/serving")  # the serving image is not the operator's
    operator, etcd = containers(docs, "Deployment"), containers(docs, "StatefulSet")
    assert operator["image"] == f"ghcr.io/pdserve/pdserve-operator:{app_version}"
    assert operator["imagePullPolicy"] == etcd["imagePullPolicy"] == "IfNotPresent"
    # A cluster whose images are loaded into its nodes (kind, k3s): nothing is pulled.
    docs = render(
        *("--set", "operator.image.repository=pdserve-operator", "--set", "operator.image.tag=dev"),
        *("--set", "operator.image.pullPolicy=Never", "--set", "etcd.image.pullPolicy=Never"),
    )
    operator, etcd = containers(docs, "Deployment"), containers(docs, "StatefulSet")
    assert operator["image"] == "pdserve-operator:dev"
    assert operator["imagePullPolicy"] == etcd["imagePullPolicy"] == "Never"


def test_every_example_names_the_crds_group_and_kind() -> None:
    # test_operator applies each example to the real server; this says which CRD they belong to.
    crd = yaml.safe_load((CHART / "crds" / "pdservedeployments.yaml").read_text())
    for example in (CHART / "examples").glob("*.yaml"):
        body = yaml.safe_load(example.read_text())
        assert (body["apiVersion"], body["kind"]) == (f"{crd['spec']['group']}/v1alpha1", crd["spec"]["names"]["kind"])


@pytest.mark.parametrize(
    ("values", "field"),
    [
        (["--set", "operator.replicas=2"], "/operator/replicas"),
        (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy"),
        (["--set", "operator.image.pullPolicy=Sometimes"], "/operator/image/pullPolicy"),
        (["--set", "etcd.image.pullPolicy=Sometimes"], "/etcd/image/pullPolicy"),
        (["--set", "etcd.enabled=false"], "etcd.endpoint"),
        (["--set", "operator.watchNamespace=Not_A_Namespace"], "/operator/watchNamespace"),
        (["--set", "operator.unknown=1"], "unknown"),
    ],
)
def test_bad_values_are_refused_naming_the_field(values: list[str], field: str) -> None:
    result = helm("template", "rel", str(CHART), *values, check=False)
    assert result.returncode != 0
    assert field in result.stderr, result.stderr


@pytest.mark.slow
def test_helm_install_and_the_operator_under_the_charts_service_account(
    kube: Kube, kube_server: KubeServer, tmp_path: Path
) -> None:
    assert kube_server.etcd is not None
    release_ns, app_ns = "pdserve-system", "llm"
    for ns in (release_ns, app_ns):
        kube.request(
            "POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
        )
    helm(
        "install",
        "rel",
        str(CHART),
        "--namespace",
        release_ns,
        "--kubeconfig",
        str(kube_server.kubeconfig),
        "--set",
        "etcd.enabled=false",
        "--set",
        f"etcd.endpoint={kube_server.etcd.url}",
    )
    sa = kube.get(object_path("ServiceAccount", release_ns, "rel-pdserve"))
    assert sa is not None
    assert kube.get(object_path("Deployment", release_ns, "rel-pdserve-operator")) is not None
    assert kube.get("/apis/rbac.authorization.k8s.io/v1/clusterroles/rel-pdserve-operator") is not None

    # The chart's service account, as the operator's pod would hold it.
    token = kube.request(
        "POST",
        f"/api/v1/namespaces/{release_ns}/serviceaccounts/rel-pdserve/token",
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}},
    )["status"]["token"]
    kubeconfig = kube_server.write_kubeconfig(tmp_path / "sa.kubeconfig", token, "system:serviceaccount:pdserve")
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "PDSERVE_ETCD")}
    log = tmp_path / "operator.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve",
                "--log-level",
                "INFO",
                "operator",
                "--kubeconfig",
                str(kubeconfig),
                "--all-namespaces",
                "--etcd",
                kube_server.etcd.url,
                "--metrics-port",
                "-1",
                "--health-port",
                "-1",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        body = yaml.safe_load((CHART / "examples" / "llama-small.yaml").read_text())
        body["metadata"]["namespace"] = app_ns
        name = kube.request("POST", object_path("PDServeDeployment", app_ns), body=body)["metadata"]["name"]
        wait_for(
            lambda: kube.get(object_path("Deployment", app_ns, f"{name}-decode")),
            60,
            "the operator (as the chart's service account) to create the decode pool",
        )
        wait_for(lambda: len(kube.list(f"/api/v1/namespaces/{app_ns}/pods")) == 4, 30, "the pods")
        make_pods_ready(kube, app_ns, f"pdserve.io/deployment={name}")

        def available() -> bool:
            conditions = ((kube.get(object_path("PDServeDeployment", app_ns, name)) or {}).get("status") or {}).get(
                "conditions", []
            )
            return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)

        # Available: the ready frontend, and a decode worker serving in etcd.
        key = asyncio.run(put_worker(kube_server.etcd.url, "Llama-3.1-8B-Instruct", f"decode-{app_ns}"))
        try:
            wait_for(available, 60, "Available, written by the operator under the chart's RBAC")
        finally:
            asyncio.run(delete_key(kube_server.etcd.url, key))
        kube.delete(object_path("Deployment", app_ns, f"{name}-prefill"))  # a child event: re-created
        wait_for(lambda: kube.get(object_path("Deployment", app_ns, f"{name}-prefill")), 30, "the prefill pool again")
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    output = log.read_text(errors="replace")
    assert "403" not in output and "Forbidden" not in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
