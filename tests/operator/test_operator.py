"""The operator against a real API server and controller-manager: each example deploys, scales,
rolls and is garbage-collected; invalid resources are refused naming the field."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from pdserve.operator.children import COMPONENT_LABEL, CONFIG_HASH, DEPLOYMENT_LABEL
from pdserve.operator.groups import GROUP_LABEL
from pdserve.operator.kube import Kube, object_path
from tests.operator.conftest import CHART, delete_key, make_pods_ready, put_worker, wait_for

# secured.yaml needs its Secrets and an etcd with TLS and auth: test_secured_operator.py deploys it.
EXAMPLES = sorted(p for p in (CHART / "examples").glob("*.yaml") if p.name != "secured.yaml")
pytestmark = pytest.mark.slow


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def create(kube: Kube, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(body)
    body["metadata"]["namespace"] = namespace
    return kube.request("POST", object_path("PDServeDeployment", namespace), body=body)


def resource(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    return kube.get(object_path("PDServeDeployment", namespace, name))


def condition(body: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    conditions = ((body or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), None)


def pruned(sent: Any, stored: Any, where: str = "spec") -> list[str]:
    """The fields of ``sent`` missing from ``stored`` (the server adds defaults, never removes)."""
    if isinstance(sent, dict) and isinstance(stored, dict):
        return [p for k, v in sent.items() for p in pruned(v, stored.get(k), f"{where}.{k}")]
    return [] if sent == stored else [where]


def deployment(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    return kube.get(object_path("Deployment", namespace, name))


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_an_example_deploys_owned_children_and_reports_its_conditions(
    kube, kube_server, operator, namespace, example
) -> None:
    created = create(kube, namespace, load(example))
    name, uid = created["metadata"]["name"], created["metadata"]["uid"]
    # The server prunes fields its schema does not know, silently: every field must survive.
    assert pruned(load(example)["spec"], created["spec"]) == [], "fields the CRD does not know"
    wanted = [("Deployment", f"{name}-{c}") for c in ("frontend", "prefill", "decode")]
    wanted += [
        ("Service", name),
        ("Service", f"{name}-prefill"),
        ("Service", f"{name}-decode"),
        ("ConfigMap", f"{name}-config"),
    ]
    for kind, child in wanted:
        obj = wait_for(lambda: kube.get(object_path(kind, namespace, child)), 30, f"{kind} {child}")
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("PDServeDeployment", name, uid, True)

    body = wait_for(
        lambda: condition(resource(kube, namespace, name), "Progressing") and resource(kube, namespace, name),
        30,
        "the status",
    )
    status = body["status"]
    assert status["observedGeneration"] == body["metadata"]["generation"]
    assert condition(body, "Available")["status"] == "False"
    assert condition(body, "Progressing")["status"] == "True"
    spec = body["spec"]
    degraded = condition(body, "Degraded")
    assert degraded["status"] == "False", degraded  # multi-rank groups within a node are served
    assert status["decode"]["desired"] == spec["decode"]["replicas"]
    assert status["decode"]["registered"] == 0  # no worker registered in etcd

    # No kubelet: the pods stay Pending until the test marks them ready, as one would.
    wait_for(
        lambda: (
            len(kube.list(f"/api/v1/namespaces/{namespace}/pods", f"{DEPLOYMENT_LABEL}={name}"))
            == sum(spec[c]["replicas"] for c in ("prefill", "decode", "frontend"))
        ),
        30,
        "the pods",
    )
    assert status["endpoints"] == {
        "openai": f"http://{name}.{namespace}.svc:{spec['frontend'].get('httpPort', 8000)}/v1",
        "grpc": f"{name}.{namespace}.svc:{spec['frontend'].get('grpcPort', 50051)}",
    }
    make_pods_ready(kube, namespace, f"{DEPLOYMENT_LABEL}={name}")
    body = wait_for(
        lambda: (b := resource(kube, namespace, name)) and condition(b, "Progressing")["status"] == "False" and b,
        60,
        "every replica ready",
    )
    ready = body["status"]["decode"]["readyOfDesired"]
    assert ready == f"{spec['decode']['replicas']}/{spec['decode']['replicas']}"
    # Ready pods serve nothing until their workers register in etcd.
    available = condition(body, "Available")
    assert (available["status"], available["reason"]) == ("False", "NoServingWorkers"), available

    # The status counts the workers registered in etcd (rebuilt on the periodic resync); a
    # decode worker makes it serve, plus a prefill worker where every prompt goes through one.
    model = spec["model"].get("name") or spec["model"]["path"].rsplit("/", 1)[-1]
    roles = ["decode"] + (["prefill"] if spec.get("router", {}).get("disaggregation") == "always" else [])
    keys = [asyncio.run(put_worker(kube_server.etcd.url, model, f"{role}-{namespace}", role)) for role in roles]
    try:
        body = wait_for(
            lambda: (
                (b := resource(kube, namespace, name))
                and b["status"]["decode"].get("registered") == 1
                and condition(b, "Available")["status"] == "True"
                and b
            ),
            45,
            "status.decode.registered to count the worker in etcd, and Available",
        )
        assert condition(body, "Available")["reason"] == "Serving"
    finally:
        for key in keys:
            asyncio.run(delete_key(kube_server.etcd.url, key))


def test_replicas_scale_the_pool_and_engine_args_roll_it(kube, operator, namespace) -> None:
    name = create(kube, namespace, load(CHART / "examples" / "llama-small.yaml"))["metadata"]["name"]
    decode = wait_for(lambda: deployment(kube, namespace, f"{name}-decode"), 30, "the decode Deployment")
    template = decode["spec"]["template"]
    path = object_path("PDServeDeployment", namespace, name)

    kube.merge_patch(path, {"spec": {"decode": {"replicas": 5}}})
    decode = wait_for(
        lambda: (d := deployment(kube, namespace, f"{name}-decode"))["spec"]["replicas"] == 5 and d,
        30,
        "the decode Deployment to follow replicas: 5",
    )
    assert decode["spec"]["template"] == template  # scaling rolls nothing

    kube.merge_patch(path, {"spec": {"decode": {"engineArgs": {"maxNumSeqs": 32}}}})
    decode = wait_for(
        lambda: (d := deployment(kube, namespace, f"{name}-decode"))["spec"]["template"] != template and d,
        30,
        "the decode pod template to change",
    )
    assert (
        decode["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH]
        != template["metadata"]["annotations"][CONFIG_HASH]
    )
    config = kube.get(object_path("ConfigMap", namespace, f"{name}-config"))
    assert "--max-num-seqs\n32\n" in config["data"]["decode.args"]
    # The deployment controller rolls the pool: a second ReplicaSet, for the new template.
    wait_for(
        lambda: (
            len(
                kube.list(
                    f"/apis/apps/v1/namespaces/{namespace}/replicasets",
                    f"{DEPLOYMENT_LABEL}={name},app.kubernetes.io/component=decode",
                )
            )
            == 2
        ),
        30,
        "the decode pool to roll",
    )
    prefill_sets = kube.list(
        f"/apis/apps/v1/namespaces/{namespace}/replicasets",
        f"{DEPLOYMENT_LABEL}={name},app.kubernetes.io/component=prefill",
    )
    assert len(prefill_sets) == 1  # the other pool did not roll
    registry = operator.metrics.registry
    assert registry.get_sample_value("pdserve_operator_reconciles_total", {"outcome": "ok"}) > 0
    assert registry.get_sample_value("pdserve_operator_reconcile_seconds_count") > 0


def test_a_deleted_child_comes_back_and_a_deleted_resource_takes_its_children(kube, operator, namespace) -> None:
    name = create(kube, namespace, load(CHART / "examples" / "llama-small.yaml"))["metadata"]["name"]
    children = [object_path("Deployment", namespace, f"{name}-{c}") for c in ("frontend", "prefill", "decode")]
    children += [object_path("ConfigMap", namespace, f"{name}-config"), object_path("Service", namespace, name)]
    for path in children:
        wait_for(lambda: kube.get(path), 30, path)
    uid = kube.get(children[1])["metadata"]["uid"]
    kube.delete(children[1])
    wait_for(lambda: (d := kube.get(children[1])) and d["metadata"]["uid"] != uid, 30, "the prefill Deployment again")

    kube.delete(object_path("PDServeDeployment", namespace, name))
    for path in children:
        wait_for(lambda: kube.get(path) is None, 60, f"the garbage collector to delete {path}")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: s["decode"].update(replicas=-1), "spec.decode.replicas"),
        (lambda s: s.pop("image"), "spec.image"),
        (lambda s: s.update(imagePullPolicy="Sometimes"), "spec.imagePullPolicy"),
        (lambda s: s["router"].update(disaggregation="maybe"), "spec.router.disaggregation"),
        (lambda s: s["prefill"].update(tensorParallelSize=0), "spec.prefill.tensorParallelSize"),
        (lambda s: s["frontend"].update(serviceType="Ingress"), "spec.frontend.serviceType"),
        (lambda s: s["slo"].update(ttftP90="fast"), "spec.slo.ttftP90"),
        (lambda s: s["frontend"].update(grpcPort=70000), "spec.frontend.grpcPort"),
    ],
)
def test_the_schema_refuses_an_invalid_resource_naming_the_field(kube, namespace, change, field) -> None:
    body = load(CHART / "examples" / "llama-small.yaml")
    change(body["spec"])
    with pytest.raises(ApiException) as refused:
        create(kube, namespace, body)
    assert refused.value.status == 422
    assert field in refused.value.body, refused.value.body


def test_a_spec_the_schema_cannot_check_is_degraded_naming_the_field(kube, operator, namespace) -> None:
    body = load(CHART / "examples" / "llama-small.yaml")
    body["spec"]["model"]["path"] = "/elsewhere/Llama"  # not under the volume's mountPath
    name = create(kube, namespace, body)["metadata"]["name"]
    degraded = wait_for(lambda: condition(resource(kube, namespace, name), "Degraded"), 30, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "spec.model.path" in degraded["message"]
    assert deployment(kube, namespace, f"{name}-decode") is None


def wide_decode() -> dict[str, Any]:
    """deepseek-v3.yaml with decode groups of 4 ranks on nodes of 2 GPUs: one rank a pod."""
    body = load(CHART / "examples" / "deepseek-v3.yaml")
    body["spec"]["decode"] |= {"dataParallelSize": 4, "gpusPerNode": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}}
    return body


def test_a_group_larger_than_a_node_runs_as_a_stateful_set_per_group(kube, operator, namespace) -> None:
    name = create(kube, namespace, wide_decode())["metadata"]["name"]
    groups = [f"{name}-decode-g{i}" for i in (0, 1)]
    for group in groups:
        for kind in ("StatefulSet", "Service"):
            wait_for(lambda: kube.get(object_path(kind, namespace, group)), 30, f"{kind} {group}")
    assert deployment(kube, namespace, f"{name}-prefill") is not None  # the pool that fits a node: as before
    assert deployment(kube, namespace, f"{name}-decode") is None
    # The StatefulSet controller makes each group's pods, named by ordinal, all at once.
    pods = f"/api/v1/namespaces/{namespace}/pods"
    wait_for(lambda: len(kube.list(pods, f"{GROUP_LABEL}")) == 8, 30, "two groups of 4 pods")
    assert sorted(p["metadata"]["name"] for p in kube.list(pods, f"{GROUP_LABEL}=1")) == [
        f"{groups[1]}-{r}" for r in range(4)
    ]
    body = wait_for(
        lambda: condition(resource(kube, namespace, name), "Degraded") and resource(kube, namespace, name),
        30,
        "the status",
    )
    assert condition(body, "Degraded")["status"] == "False", condition(body, "Degraded")
    assert body["status"]["decode"]["readyOfDesired"] == "0/2"

    # A group is ready once all its pods are: 3 of 4 is not.
    decode = f"{DEPLOYMENT_LABEL}={name},{COMPONENT_LABEL}=decode"
    for pod in kube.list(pods, f"{decode},{GROUP_LABEL}=0")[:3]:
        make_pods_ready(kube, namespace, f"statefulset.kubernetes.io/pod-name={pod['metadata']['name']}")
    make_pods_ready(kube, namespace, f"{decode},{GROUP_LABEL}=1")
    wait_for(
        lambda: kube.get(object_path("StatefulSet", namespace, groups[0])).get("status", {}).get("readyReplicas") == 3,
        30,
        "3 ready pods in group 0",
    )
    body = wait_for(
        lambda: (b := resource(kube, namespace, name)) and b["status"]["decode"]["ready"] == 1 and b,
        30,
        "one ready group",
    )
    make_pods_ready(kube, namespace, f"{decode},{GROUP_LABEL}=0")
    wait_for(
        lambda: resource(kube, namespace, name)["status"]["decode"]["readyOfDesired"] == "2/2", 30, "two ready groups"
    )

    # Scaling to one group removes the second group's StatefulSet and Service, not the first's.
    kube.merge_patch(object_path("PDServeDeployment", namespace, name), {"spec": {"decode": {"replicas": 1}}})
    for kind in ("StatefulSet", "Service"):
        wait_for(lambda: kube.get(object_path(kind, namespace, groups[1])) is None, 30, f"{kind} {groups[1]} pruned")
        assert kube.get(object_path(kind, namespace, groups[0])) is not None
    wait_for(
        lambda: resource(kube, namespace, name)["status"]["decode"]["readyOfDesired"] == "1/1", 30, "one group of one"
    )
    assert kube.get(object_path("Service", namespace, f"{name}-decode")) is not None  # the pool's metrics Service


LWS_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "leaderworkersets.leaderworkerset.x-k8s.io"},
    "spec": {
        "group": "leaderworkerset.x-k8s.io",
        "scope": "Namespaced",
        "names": {"kind": "LeaderWorkerSet", "plural": "leaderworkersets", "singular": "leaderworkerset"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
            }
        ],
    },
}


def test_with_leader_worker_set_installed_a_multi_node_pool_runs_as_one(kube, operator, namespace) -> None:
    # The LeaderWorkerSet API only (its controller is not needed to see the operator's object).
    crd_path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{LWS_CRD['metadata']['name']}"
    kube.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body=LWS_CRD)
    try:
        wait_for(lambda: kube.get(object_path("LeaderWorkerSet", namespace)) is not None, 30, "the LWS API")
        created = create(kube, namespace, wide_decode())
        name = created["metadata"]["name"]
        lws = wait_for(
            lambda: kube.get(object_path("LeaderWorkerSet", namespace, f"{name}-decode")),
            30,
            "the decode LeaderWorkerSet",
        )
        assert lws["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
        group = lws["spec"]["leaderWorkerTemplate"]
        assert (group["size"], group["restartPolicy"], lws["spec"]["replicas"]) == (4, "RecreateGroupOnPodRestart", 2)
        assert kube.list(object_path("StatefulSet", namespace)) == []
        body = wait_for(
            lambda: condition(resource(kube, namespace, name), "Degraded") and resource(kube, namespace, name),
            30,
            "the status",
        )
        assert condition(body, "Degraded")["status"] == "False", condition(body, "Degraded")
        # No LWS controller here: its status reports no ready group, and the pool says so.
        assert body["status"]["decode"]["readyOfDesired"] == "0/2"
    finally:
        kube.delete(crd_path)
