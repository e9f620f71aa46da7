"""The Kubernetes connector patches only the replicas (and the live knobs) of the custom resource."""

import sys

import pytest

from pdserve.discovery.knobs import Knobs
from pdserve.extras import MissingExtra
from pdserve.planner.scaling import KubernetesConnector
from tests.utils.aio import run_scenario


class FakeCustomObjectsApi:
    """Records calls like kubernetes.client.CustomObjectsApi would receive them."""

    def __init__(self) -> None:
        self.body = {"spec": {"model": "/models/llama", "prefill": {"replicas": 2}, "decode": {"replicas": 3}}}
        self.patches = []

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        assert (group, version, plural) == ("pdserve.io", "v1alpha1", "pdservedeployments")
        assert (namespace, name) == ("serving", "llama")
        return self.body

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body):
        assert (group, version, namespace, plural, name) == (
            "pdserve.io",
            "v1alpha1",
            "serving",
            "pdservedeployments",
            "llama",
        )
        self.patches.append(body)
        return self.body


def test_current_scale_and_knobs():
    api = FakeCustomObjectsApi()
    connector = KubernetesConnector("llama", "serving", api=api)
    assert run_scenario(connector.current()) == (2, 3)
    run_scenario(connector.scale(4, 6))
    assert api.patches[-1] == {"spec": {"prefill": {"replicas": 4}, "decode": {"replicas": 6}}}
    run_scenario(connector.set_knobs(Knobs(decode_max_num_seqs=32, local_prefill_threshold_tokens=128)))
    assert api.patches[-1] == {
        "spec": {
            "tuning": {
                "decodeMaxNumSeqs": 32,
                "decodeMaxNumBatchedTokens": 2048,
                "prefillChunkSize": 2048,
                "localPrefillThresholdTokens": 128,
            }
        }
    }
    with pytest.raises(ValueError):
        run_scenario(connector.scale(-1, 1))


def test_a_clear_error_without_the_kubernetes_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # makes `import kubernetes` fail
    with pytest.raises(MissingExtra, match=r"pip install 'pdserve\[k8s\]'"):
        run_scenario(KubernetesConnector("llama").current())
