"""The planner's KubernetesConnector against the real API server: it writes replicas, the
operator makes the pools follow, and the rest of the spec stays as it was."""

from __future__ import annotations

import asyncio
import copy

import pytest
import yaml
from kubernetes import client as k8s

from pdserve.discovery.knobs import Knobs
from pdserve.operator.kube import object_path
from pdserve.planner.scaling import KubernetesConnector
from tests.operator.conftest import CHART, wait_for

pytestmark = pytest.mark.slow


def test_the_connector_scales_through_the_api_server(kube, kube_server, operator, namespace) -> None:
    body = yaml.safe_load((CHART / "examples" / "llama-small.yaml").read_text())
    body["metadata"]["namespace"] = namespace
    name = kube.request("POST", object_path("PDServeDeployment", namespace), body=body)["metadata"]["name"]
    before = copy.deepcopy(kube.get(object_path("PDServeDeployment", namespace, name))["spec"])
    api = k8s.CustomObjectsApi(k8s.ApiClient(kube_server.configuration()))
    connector = KubernetesConnector(name, namespace, api=api)

    async def scenario() -> tuple[int, int]:
        assert await connector.current() == (1, 2)
        await connector.scale(3, 4)
        await connector.set_knobs(Knobs(decode_max_num_seqs=32))
        return await connector.current()

    assert asyncio.run(scenario()) == (3, 4)
    for component, replicas in (("prefill", 3), ("decode", 4)):
        wait_for(
            lambda: (
                (kube.get(object_path("Deployment", namespace, f"{name}-{component}")) or {})
                .get("spec", {})
                .get("replicas")
                == replicas
            ),
            30,
            f"the {component} Deployment at {replicas}",
        )
    after = kube.get(object_path("PDServeDeployment", namespace, name))["spec"]
    assert after["tuning"]["decodeMaxNumSeqs"] == 32
    for key in ("prefill", "decode"):
        before[key]["replicas"] = after[key]["replicas"]
    del after["tuning"]
    assert after == before  # the connector touched only replicas (and the tuning mirror)
