"""``pdserve remove-deployments`` (what the chart's pre-delete hook runs) against the real API
server and garbage collector: every PDServeDeployment in its scope and all their children go
before it returns, another namespace is left alone, and a pod that does not go ends it at its
deadline naming that pod."""

from __future__ import annotations

import copy
from collections.abc import Iterator
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.operator.children import DEPLOYMENT_LABEL
from pdserve.operator.kube import Kube, object_path
from tests.operator.conftest import CHART, wait_for
from tests.utils.kube_server import KubeServer

EXAMPLE = yaml.safe_load((CHART / "examples" / "llama-small.yaml").read_text())
HOLD = "pdserve.io/test-hold"
pytestmark = pytest.mark.slow


def remove_deployments(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess:
    """The command as the hook's pod runs it (its own interpreter, a kubeconfig, no $KUBECONFIG)."""
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG" and not k.startswith("PDSERVE_")}
    return subprocess.run(
        [sys.executable, "-m", "pdserve", "remove-deployments", "--kubeconfig", str(kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def deploy(kube: Kube, namespace: str, name: str) -> None:
    """A PDServeDeployment, once the operator has made its children and their pods exist."""
    body: dict[str, Any] = copy.deepcopy(EXAMPLE)
    body["metadata"].update(name=name, namespace=namespace)
    kube.request("POST", object_path("PDServeDeployment", namespace), body=body)
    wait_for(lambda: kube.get(object_path("Deployment", namespace, f"{name}-decode")), 60, f"{name}'s decode pool")
    wait_for(lambda: pods(kube, namespace, name), 30, f"{name}'s pods")


def pods(kube: Kube, namespace: str, name: str) -> list[dict[str, Any]]:
    return kube.list(object_path("Pod", namespace), f"{DEPLOYMENT_LABEL}={name}")


def what_is_left(kube: Kube, namespace: str, name: str) -> list[str]:
    left = [f"PDServeDeployment {name}"] if kube.get(object_path("PDServeDeployment", namespace, name)) else []
    for kind in ("Deployment", "Service", "ConfigMap", "Pod"):
        left += [
            f"{kind} {o['metadata']['name']}"
            for o in kube.list(object_path(kind, namespace), f"{DEPLOYMENT_LABEL}={name}")
        ]
    return left


@pytest.fixture
def other_namespace(kube: Kube, namespace: str) -> Iterator[str]:
    other = f"{namespace}-b"
    kube.request(
        "POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": other}}
    )
    yield other
    kube.delete(f"/api/v1/namespaces/{other}")


def test_all_namespaces_deletes_every_resource_and_waits_for_its_children(
    kube: Kube, kube_server: KubeServer, operator, namespace: str, other_namespace: str
) -> None:
    deploy(kube, namespace, "model-a")
    deploy(kube, other_namespace, "model-b")
    result = remove_deployments(kube_server.kubeconfig, "--all-namespaces", "--timeout", "60s")
    assert result.returncode == 0, result.stdout + result.stderr
    # Returned only once all is gone: nothing is left to wait for here.
    assert what_is_left(kube, namespace, "model-a") == []
    assert what_is_left(kube, other_namespace, "model-b") == []
    # The log says what it deleted and what it waited for.
    assert f"deleting PDServeDeployment {namespace}/model-a" in result.stdout
    assert f"deleting PDServeDeployment {other_namespace}/model-b" in result.stdout
    assert "waiting for" in result.stdout and f"Pod {namespace}/model-a-decode-" in result.stdout
    assert "done: " in result.stdout.splitlines()[-1]


def test_one_namespace_leaves_the_others_alone(
    kube: Kube, kube_server: KubeServer, operator, namespace: str, other_namespace: str
) -> None:
    deploy(kube, namespace, "model-a")
    deploy(kube, other_namespace, "model-b")
    result = remove_deployments(kube_server.kubeconfig, "--namespace", namespace, "--timeout", "60s")
    assert result.returncode == 0, result.stdout + result.stderr
    assert what_is_left(kube, namespace, "model-a") == []
    assert other_namespace not in result.stdout
    assert kube.get(object_path("PDServeDeployment", other_namespace, "model-b")) is not None
    assert kube.get(object_path("Deployment", other_namespace, "model-b-decode")) is not None
    assert pods(kube, other_namespace, "model-b")


def test_a_pod_that_does_not_go_ends_it_at_its_deadline_naming_the_pod(
    kube: Kube, kube_server: KubeServer, operator, namespace: str
) -> None:
    deploy(kube, namespace, "stuck")
    # A finalizer holds the pod as a drain that never ends would on a real node.
    held = pods(kube, namespace, "stuck")[0]["metadata"]["name"]
    kube.merge_patch(object_path("Pod", namespace, held), {"metadata": {"finalizers": [HOLD]}})
    try:
        result = remove_deployments(kube_server.kubeconfig, "--namespace", namespace, "--timeout", "3s")
        assert result.returncode == 1, result.stdout + result.stderr
        error = result.stderr.strip().splitlines()[-1]
        assert error.startswith("pdserve remove-deployments: error: after 3 s, still there"), result.stderr
        assert f"Pod {namespace}/{held} (" in error and f"finalizers {HOLD}" in error, error
        assert kube.get(object_path("PDServeDeployment", namespace, "stuck")) is None
    finally:
        kube.merge_patch(object_path("Pod", namespace, held), {"metadata": {"finalizers": None}})
    wait_for(lambda: what_is_left(kube, namespace, "stuck") == [], 30, "the rest to go once the pod is let go")
