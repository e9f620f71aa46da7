"""The status function alone: Available means the deployment serves (a ready frontend and
workers serving in etcd), the endpoints name the frontend Service, and an unchanged world
writes an identical status."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from pdserve.operator.args import disaggregation
from pdserve.operator.children import Owner, service
from pdserve.operator.spec import parse_spec
from pdserve.operator.status import Observed, build_status, service_endpoints
from tests.operator.conftest import CHART

T0, T1 = "2025-01-01T00:00:00Z", "2025-01-01T00:01:00Z"
# Every replica ready: what the old count of ready pods called Available.
ALL_READY = Observed(
    generation=3,
    desired={"prefill": 1, "decode": 2, "frontend": 1},
    ready={"prefill": 1, "decode": 2, "frontend": 1},
    updated={"prefill": 1, "decode": 2, "frontend": 1},
    registered={"prefill": 1, "decode": 2},
)


def available(observed: Observed) -> dict[str, str]:
    return next(c for c in build_status(observed, None, T0)["conditions"] if c["type"] == "Available")


def test_serving_needs_a_ready_frontend_and_a_decode_worker_in_etcd() -> None:
    assert available(ALL_READY)["status"] == "True"
    assert available(ALL_READY)["reason"] == "Serving"
    # Ready pods whose workers have not registered (or drain) do not serve.
    idle = available(dataclasses.replace(ALL_READY, registered={"prefill": 1, "decode": 0}))
    assert (idle["status"], idle["reason"]) == ("False", "NoServingWorkers")
    assert "no decode worker serves" in idle["message"]
    no_frontend = available(dataclasses.replace(ALL_READY, ready={"prefill": 1, "decode": 2, "frontend": 0}))
    assert (no_frontend["status"], no_frontend["reason"]) == ("False", "FrontendUnavailable")
    # conditional and off prefill on the decode worker: no prefill worker, no pod of them ready, still serving.
    decode_only = dataclasses.replace(
        ALL_READY, ready={"prefill": 0, "decode": 2, "frontend": 1}, registered={"prefill": 0, "decode": 1}
    )
    assert available(decode_only)["status"] == "True"


def test_always_disaggregated_needs_a_prefill_worker_too() -> None:
    always = dataclasses.replace(ALL_READY, needs_prefill=True)
    assert available(always)["status"] == "True"
    starved = available(dataclasses.replace(always, registered={"prefill": 0, "decode": 2}))
    assert (starved["status"], starved["reason"]) == ("False", "NoServingWorkers")
    assert "no prefill worker serves" in starved["message"]


def test_an_unreadable_registry_is_not_available_and_says_why() -> None:
    blind = dataclasses.replace(ALL_READY, registered=None, registry_error="etcd at http://etcd:2379: no answer")
    status = build_status(blind, None, T0)
    condition = status["conditions"][0]
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "Available",
        "False",
        "RegistryUnreachable",
    )
    assert "etcd at http://etcd:2379: no answer" in condition["message"]
    assert status["decode"]["registered"] is None  # a merge patch's null: no stale count stays


def test_the_frontend_mode_decides_whether_prefill_is_needed() -> None:
    body = yaml.safe_load((CHART / "examples" / "llama-small.yaml").read_text())
    assert disaggregation(parse_spec(body)) == "conditional"
    del body["spec"]["router"]
    assert disaggregation(parse_spec(body)) == "conditional"  # the frontend's own default
    body["spec"]["router"] = {"disaggregation": "always"}
    assert disaggregation(parse_spec(body)) == "always"
    body["spec"]["frontend"]["args"] = {"disaggregation": "off"}  # last on its command line: it wins
    assert disaggregation(parse_spec(body)) == "off"


@pytest.mark.parametrize(("tls", "scheme"), [(False, "http"), (True, "https")])
def test_the_endpoints_name_the_frontend_service_in_cluster_dns(tls: bool, scheme: str) -> None:
    body = yaml.safe_load((CHART / "examples" / "llama-small.yaml").read_text())
    body["spec"]["frontend"].update(grpcPort=7000, httpPort=7080)
    if tls:
        body["spec"]["tls"] = {"secretName": "certs"}
    spec = parse_spec(body)
    frontend = service(spec, Owner("llama", "serving", "uid"), "frontend")
    endpoints = service_endpoints(frontend, spec.tls is not None)
    assert endpoints == {"openai": f"{scheme}://llama.serving.svc:7080/v1", "grpc": "llama.serving.svc:7000"}
    assert build_status(dataclasses.replace(ALL_READY, endpoints=endpoints), None, T0)["endpoints"] == endpoints
    assert build_status(ALL_READY, None, T0)["endpoints"] is None  # no Service yet: none (and none left over)


@pytest.mark.parametrize(
    "observed",
    [ALL_READY, dataclasses.replace(ALL_READY, registered=None, registry_error="down")],
    ids=["serving", "registry-down"],
)
def test_an_unchanged_world_writes_an_identical_status(observed: Observed) -> None:
    first = build_status(observed, None, T0)
    assert build_status(observed, first, T1) == first
    # A change moves only the condition that changed.
    later = build_status(dataclasses.replace(observed, registered={"prefill": 1, "decode": 0}), first, T1)
    times = {c["type"]: c["lastTransitionTime"] for c in later["conditions"]}
    assert times["Progressing"] == T0
    assert times["Available"] == (T0 if observed.registered is None else T1)
