"""A real API server for the session, the CRD installed once, the operator running under kopf's
KopfRunner, and a namespace of its own for each test."""

from __future__ import annotations

import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import urllib3
import yaml
from kopf.testing import KopfRunner

from pdserve.discovery.etcd import close_quietly, connect
from pdserve.discovery.etcd_auth import EtcdAuth
from pdserve.discovery.registry import WorkerEntry, encode_entry
from pdserve.operator import handlers
from pdserve.operator.kube import Kube
from pdserve.operator.reconcile import Settings
from tests.utils.kube_server import KubeServer

CHART = Path(__file__).parents[2] / "charts" / "pdserve"
CRD = CHART / "crds" / "pdservedeployments.yaml"
T = TypeVar("T")


@pytest.fixture(scope="session")
def kube_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeServer]:
    """kube-apiserver + controller-manager (garbage collector, deployments) on a real etcd."""
    # The test server's certificate is self-signed; the tests do not verify it.
    warnings.filterwarnings("ignore", category=urllib3.exceptions.InsecureRequestWarning)
    server = KubeServer(tmp_path_factory.mktemp("kube")).start()
    kube = Kube(server.configuration())
    kube.request(
        "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body=yaml.safe_load(CRD.read_text())
    )
    wait_for(lambda: _crd_established(kube), 30, "the CRD to be established")
    kube.close()
    yield server
    server.close()


def _crd_established(kube: Kube) -> bool:
    crd = kube.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/pdservedeployments.pdserve.io")
    conditions = ((crd or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


@pytest.fixture(scope="session")
def kube(kube_server: KubeServer) -> Iterator[Kube]:
    """An admin client of the test server."""
    client = Kube(kube_server.configuration())
    yield client
    client.close()


@pytest.fixture(scope="module")
def operator(kube_server: KubeServer) -> Iterator[handlers.Reconciler]:
    """The operator, cluster-wide, as the admin, for one test module (test_chart runs its own
    under the chart's RBAC, which must be alone to show what that RBAC allows)."""
    assert kube_server.etcd is not None
    reconciler = handlers.Reconciler(kube_server.configuration(), None, Settings(default_etcd=kube_server.etcd.url))
    handlers.configure(reconciler)
    with KopfRunner(
        ["run", "--standalone", "--all-namespaces", "-m", "pdserve.operator.handlers"], timeout=60
    ) as runner:
        yield reconciler
    assert runner.exit_code == 0, runner.output


@pytest.fixture
def namespace(kube: Kube) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.request(
        "POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    )
    yield name
    kube.delete(f"/api/v1/namespaces/{name}")


def wait_for(probe: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.2) -> T:
    """``probe()``'s first truthy value within ``timeout_s``; fails naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def make_pods_ready(kube: Kube, namespace: str, selector: str) -> int:
    """Mark the selected pods Running and Ready, as a kubelet would (there is none); how many."""
    pods = kube.list(f"/api/v1/namespaces/{namespace}/pods", selector)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for pod in pods:
        status: dict[str, Any] = {
            "phase": "Running",
            "podIP": "10.1.0.1",
            "conditions": [
                {"type": kind, "status": "True", "lastTransitionTime": now}
                for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
            ],
        }
        kube.request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}/status",
            body={"status": status},
            content_type="application/merge-patch+json",
        )
    return len(pods)


async def put_worker(url: str, model: str, worker_id: str, role: str = "decode", auth: EtcdAuth | None = None) -> str:
    """A worker's registry entry, as a worker writes it (as ``auth``'s etcd user, if given); its key."""
    entry = WorkerEntry(
        worker_id=worker_id,
        role=role,
        model=model,
        model_path="/models/x",
        endpoint="10.1.0.1:50051",
        nixl=b"",
        block_size=16,
        num_kv_blocks=64,
        max_model_len=2048,
        vocab_size=320,
        max_num_seqs=64,
        started_at=time.time(),
    )
    client = await connect(url, auth=auth or EtcdAuth())
    try:
        await client.put(entry.key.encode(), encode_entry(entry))
    finally:
        await close_quietly(client)
    return entry.key


async def delete_key(url: str, key: str, auth: EtcdAuth | None = None) -> None:
    client = await connect(url, auth=auth or EtcdAuth())
    try:
        await client.delete(key.encode())
    finally:
        await close_quietly(client)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The test server's certificate is self-signed, and its clients do not verify it.
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"))
