"""The Helm chart: lint, render over a values matrix (every manifest checked against the
Kubernetes schemas), refuse bad values naming them, install into the real API server, and run
the operator under the chart's own service account without a single 403; render the uninstall
hook (its Job, its deadlines, its RBAC) and run its command under that RBAC on the real server
(which has no kubelet to run the Job itself)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pdserve.operator.kube import Kube, object_path
from pdserve.types.duration import parse_duration
from tests.operator.conftest import CHART, delete_key, make_pods_ready, put_worker, wait_for
from tests.utils.kube_server import KubeServer, k8s_binary

# The oldest schemas kubernetes-validate ships; v1.20-only objects (policy/v1beta1) are
# checked by the real v1.20 server in the install test instead.
SCHEMA_VERSION = "1.25"
BUILTIN_GROUPS = {"v1", "apps/v1", "batch/v1", "policy/v1", "rbac.authorization.k8s.io/v1"}
# `helm uninstall --timeout`'s default: the hook Job must finish (or fail) before it.
HELM_UNINSTALL_TIMEOUT_S = 300

VALUES_MATRIX = {
    "defaults": [],
    "one-namespace": ["--set", "operator.watchNamespace=llm"],
    "external-etcd": ["--set", "etcd.enabled=false", "--set", "etcd.endpoint=http://etcd.infra:2379"],
    "etcd-persistent": ["--set", "etcd.persistence.enabled=true", "--set", "etcd.persistence.storageClassName=ssd"],
    "own-service-account": ["--set", "serviceAccount.create=false", "--set", "serviceAccount.name=ops"],
    "dashboards": ["--set", "dashboards.enabled=true"],
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
    assert any(d["kind"] == "ServiceAccount" and not hook(d) for d in docs) == (case != "own-service-account")
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


def hook(doc: dict[str, Any]) -> str | None:
    return (doc["metadata"].get("annotations") or {}).get("helm.sh/hook")


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


# The keywords a structural schema may use (apiextensions.k8s.io/v1 JSONSchemaProps).
SCHEMA_KEYWORDS = {
    "type",
    "description",
    "properties",
    "required",
    "items",
    "default",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "pattern",
    "enum",
    "format",
    "additionalProperties",
    "minProperties",
    "maxProperties",
    "minItems",
    "maxItems",
    "uniqueItems",
    "nullable",
    "oneOf",
    "anyOf",
    "allOf",
    "not",
    "title",
    "example",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-int-or-string",
    "x-kubernetes-embedded-resource",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
}


def test_the_crd_schema_uses_only_schema_keywords() -> None:
    """A YAML slip (an unquoted description with ", " in a flow mapping) adds a key that is a
    sentence; helm's install of the CRD then fails on the server, while a plain create passes."""
    crd = yaml.safe_load((CHART / "crds" / "pdservedeployments.yaml").read_text())

    def unknown(schema: Any, path: str) -> list[str]:
        if not isinstance(schema, dict):
            return []
        found = [f"{path}: {key!r}" for key in schema if key not in SCHEMA_KEYWORDS]
        for key, value in (schema.get("properties") or {}).items():
            found += unknown(value, f"{path}.{key}")
        for key in ("items", "additionalProperties", "not"):
            found += unknown(schema.get(key), f"{path}.{key}")
        for key in ("oneOf", "anyOf", "allOf"):
            for index, value in enumerate(schema.get(key) or []):
                found += unknown(value, f"{path}.{key}[{index}]")
        return found

    for version in crd["spec"]["versions"]:
        bad = unknown(version["schema"]["openAPIV3Schema"], version["name"])
        assert not bad, bad


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
    # A 403, not the milliseconds of a log line's time ("01:38:58,403").
    assert not re.search(r"(?<![\d,])403(?!\d)", output) and "Forbidden" not in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def uninstall_hook(*values: str) -> dict[tuple[str, str], dict[str, Any]]:
    """The uninstall hook's objects by (kind, name)."""
    docs = render("--show-only", "templates/uninstall-hook.yaml", *values)
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def rules_for(role: dict[str, Any], group: str, resource: str) -> set[str]:
    return {
        verb for r in role["rules"] if group in r["apiGroups"] and resource in r["resources"] for verb in r["verbs"]
    }


@pytest.mark.parametrize("case", ["defaults", "one-namespace"])
def test_the_uninstall_hook_removes_every_watched_resource_before_the_operator_goes(case: str) -> None:
    objects = uninstall_hook(*VALUES_MATRIX[case])
    name = "rel-pdserve-uninstall"
    job = objects[("Job", name)]
    # Before anything of the release is deleted (the operator and etcd still run), and gone after.
    for obj in objects.values():
        annotations = obj["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-delete"
        assert set(annotations["helm.sh/hook-delete-policy"].split(",")) == {"before-hook-creation", "hook-succeeded"}
    weights = {kind: int(obj["metadata"]["annotations"]["helm.sh/hook-weight"]) for (kind, _), obj in objects.items()}
    assert max(w for kind, w in weights.items() if kind != "Job") < weights["Job"]  # its RBAC first
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == containers(render(), "Deployment")["image"]  # the operator's image
    assert pod["serviceAccountName"] == name and pod["restartPolicy"] == "Never"
    scope = "--namespace=llm" if case == "one-namespace" else "--all-namespaces"
    assert container["args"][:2] == ["remove-deployments", scope]
    # Deadlines inside one another: the command's wait < the Job's < helm uninstall's.
    (timeout,) = [a.removeprefix("--timeout=") for a in container["args"] if a.startswith("--timeout=")]
    assert parse_duration(timeout) < job["spec"]["activeDeadlineSeconds"] < HELM_UNINSTALL_TIMEOUT_S
    assert job["spec"]["backoffLimit"] == 0  # a retry would start a second full wait past the deadline
    # Its own RBAC, only what it needs, in the operator's scope.
    role = objects[("ClusterRole", name)]
    assert rules_for(role, "pdserve.io", "pdservedeployments") == {"list", "delete"}
    assert rules_for(role, "", "pods") == {"list"}
    assert rules_for(role, "apps", "deployments") == {"list"}
    assert all(set(r["verbs"]) <= {"list", "delete"} for r in role["rules"])
    assert ("ServiceAccount", name) in objects
    binding = objects[("RoleBinding" if case == "one-namespace" else "ClusterRoleBinding", name)]
    assert binding["metadata"].get("namespace") == ("llm" if case == "one-namespace" else None)
    assert binding["roleRef"]["name"] == name
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": "pds"}]


def test_the_uninstall_hook_follows_its_values() -> None:
    job = uninstall_hook("--set", "uninstallHook.timeoutSeconds=600")[("Job", "rel-pdserve-uninstall")]
    assert (
        job["spec"]["activeDeadlineSeconds"] == 600
        and "--timeout=570s" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    # Without the chart's RBAC it runs as the operator's own service account, which must hold the rights.
    objects = uninstall_hook("--set", "rbac.create=false", "--set", "serviceAccount.name=ops")
    assert set(objects) == {("Job", "rel-pdserve-uninstall")}
    assert objects[("Job", "rel-pdserve-uninstall")]["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    assert not [d for d in render("--set", "uninstallHook.enabled=false") if hook(d)]
    result = helm("template", "rel", str(CHART), "--set", "uninstallHook.timeoutSeconds=10", check=False)
    assert result.returncode != 0 and "/uninstallHook/timeoutSeconds" in result.stderr, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("case", ["defaults", "one-namespace"])
def test_the_uninstall_hooks_rbac_lets_its_command_run_in_its_scope_and_no_further(
    kube: Kube, kube_server: KubeServer, tmp_path: Path, case: str
) -> None:
    release, release_ns = f"rm{case[:3]}", f"rm-{case[:3]}-system"
    scoped, other = f"rm-{case[:3]}-a", f"rm-{case[:3]}-b"
    for ns in (release_ns, scoped, other):
        kube.request(
            "POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
        )
    values = ["--set", f"operator.watchNamespace={scoped}"] if case == "one-namespace" else []
    docs = helm(
        "template",
        release,
        str(CHART),
        "--namespace",
        release_ns,
        "--show-only",
        "templates/uninstall-hook.yaml",
        *values,
    ).stdout
    job = None
    for doc in (d for d in yaml.safe_load_all(docs) if d):
        if doc["kind"] == "Job":
            job = doc
            continue
        namespace = doc["metadata"].get("namespace")
        kube.request("POST", object_path_of(doc["apiVersion"], doc["kind"], namespace), body=doc)
    assert job is not None
    body = yaml.safe_load((CHART / "examples" / "llama-small.yaml").read_text())
    for ns in (scoped, other):
        body["metadata"]["namespace"] = ns
        kube.request("POST", object_path("PDServeDeployment", ns), body=body)
    name = body["metadata"]["name"]

    # The Job's own command line, under the Job's service account (as its pod would hold it).
    sa = job["spec"]["template"]["spec"]["serviceAccountName"]
    token = kube.request(
        "POST",
        f"/api/v1/namespaces/{release_ns}/serviceaccounts/{sa}/token",
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 600}},
    )["status"]["token"]
    kubeconfig = kube_server.write_kubeconfig(tmp_path / "hook.kubeconfig", token, f"system:serviceaccount:{sa}")
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG" and not k.startswith("PDSERVE_")}

    def run(*command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pdserve", *command, "--kubeconfig", str(kubeconfig)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    if case == "one-namespace":
        # Bound in its namespace only: everywhere else is refused at once, naming the permission.
        refused = run("remove-deployments", "--all-namespaces", "--timeout", "60s")
        assert refused.returncode == 1 and "403 Forbidden" in refused.stderr, refused.stdout + refused.stderr
        assert "cannot list resource" in refused.stderr, refused.stderr
    result = run(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Forbidden" not in result.stdout + result.stderr
    assert kube.get(object_path("PDServeDeployment", scoped, name)) is None
    assert (kube.get(object_path("PDServeDeployment", other, name)) is None) == (case == "defaults")
    kube.delete(object_path("PDServeDeployment", other, name))


def object_path_of(api_version: str, kind: str, namespace: str | None) -> str:
    """Where to POST an object of the hook's kinds."""
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    plural = {"ServiceAccount": "serviceaccounts", "ClusterRole": "clusterroles"}.get(kind, kind.lower() + "s")
    return f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
