"""Pools whose group spans pods, as rendered: a LeaderWorkerSet, else a StatefulSet and a
headless Service per group; the shell wrappers of a StatefulSet pod run as a pod runs them."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import kubernetes_validate
import pytest

from pdserve.operator import args as cmd
from pdserve.operator.groups import GROUP_LABEL
from pdserve.operator.spec import SpecError, parse_spec
from tests.operator.test_children import children, example

PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def wide_decode() -> dict:
    """deepseek-v3.yaml with decode groups of 16 ranks (two nodes of 8 GPUs), a GPU a pod."""
    body = example("deepseek-v3.yaml")
    body["spec"]["decode"]["dataParallelSize"] = 16
    body["spec"]["decode"]["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    return body


def test_with_leader_worker_set_a_group_is_one_lws_group_of_one_rank_a_pod() -> None:
    objects = children(wide_decode(), lws=True)
    assert ("Deployment", "llama-decode") not in objects and ("Deployment", "llama-prefill") in objects
    lws = objects[("LeaderWorkerSet", "llama-decode")]["spec"]
    group = lws["leaderWorkerTemplate"]
    assert (lws["replicas"], group["size"]) == (2, 16)
    assert (group["restartPolicy"], lws["startupPolicy"]) == ("RecreateGroupOnPodRestart", "LeaderCreated")
    [leader] = group["leaderTemplate"]["spec"]["containers"]
    [worker] = group["workerTemplate"]["spec"]["containers"]
    # LWS gives the env: no group flags, one command line for both.
    assert leader["args"] == worker["args"] and not any(a.startswith("--group") for a in leader["args"])
    assert leader["resources"] == worker["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert set(PROBES) <= set(leader) and not set(PROBES) & set(worker)
    assert {"name": "rendezvous", "containerPort": cmd.RENDEZVOUS_PORT, "protocol": "TCP"} in worker["ports"]
    assert ("Service", "llama-decode") in objects  # the pool's metrics Service, as before


def test_without_it_each_group_is_a_stateful_set_with_a_headless_service() -> None:
    objects = children(wide_decode())
    assert ("Deployment", "llama-decode") not in objects and ("Deployment", "llama-prefill") in objects
    assert not any(kind == "LeaderWorkerSet" for kind, _ in objects)
    for index in (0, 1):
        name = f"llama-decode-g{index}"
        sts, svc = objects[("StatefulSet", name)], objects[("Service", name)]
        spec = sts["spec"]
        assert (spec["replicas"], spec["serviceName"], spec["podManagementPolicy"]) == (16, name, "Parallel")
        # Each group selects its own pods alone.
        assert spec["selector"]["matchLabels"][GROUP_LABEL] == str(index)
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
        assert svc["spec"]["selector"] == spec["selector"]["matchLabels"]
        assert (svc["spec"]["clusterIP"], svc["spec"]["publishNotReadyAddresses"]) == ("None", True)
        [container] = spec["template"]["spec"]["containers"]
        tail = container["args"][-4:]
        assert tail == ["--leader-address", f"{name}-0.{name}.serving.svc:{cmd.RENDEZVOUS_PORT}", "--group-size", "16"]
        assert container["args"][0] == f"@{cmd.CONFIG_DIR}/decode.args"
        assert container["command"][:2] == ["sh", "-c"]
        assert container["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
        assert all("exec" in container[probe] for probe in PROBES)
    assert ("StatefulSet", "llama-decode-g2") not in objects
    for obj in objects.values():
        kubernetes_validate.validate(obj, "1.25", strict=True)


def test_a_pool_that_fits_a_node_is_a_deployment_as_before() -> None:
    for lws in (False, True):
        objects = children(example("deepseek-v3.yaml"), lws=lws)
        assert {kind for kind, _ in objects} == {"ConfigMap", "Deployment", "Service"}
        [container] = objects[("Deployment", "llama-decode")]["spec"]["template"]["spec"]["containers"]
        assert "command" not in container and not any(a.startswith("--group") for a in container["args"])


def test_a_group_larger_than_a_node_takes_one_gpu_a_pod() -> None:
    body = wide_decode()
    body["spec"]["decode"]["resources"] = {"limits": {"nvidia.com/gpu": 8}}
    with pytest.raises(SpecError, match=r"spec\.decode\.resources\.limits\.nvidia\.com/gpu: .* got 8"):
        parse_spec(body)


def run_in_pod(argv: list[str], pod_name: str, path: str) -> subprocess.CompletedProcess:
    env = {"PATH": path, "POD_NAME": pod_name}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)


def test_a_stateful_set_pod_runs_pdserve_with_its_ordinal_as_group_index(tmp_path: Path) -> None:
    # A `pdserve` that prints its arguments stands in for the image's.
    fake = tmp_path / "pdserve"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    [container] = children(wide_decode())[("StatefulSet", "llama-decode-g1")]["spec"]["template"]["spec"]["containers"]
    ran = run_in_pod(container["command"] + container["args"], "llama-decode-g1-11", f"{tmp_path}:{os.environ['PATH']}")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == container["args"] + ["--group-index", "11"]


class _Probe(http.server.BaseHTTPRequestHandler):
    status = 503

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/readyz" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(("ordinal", "status", "passes"), [(0, 200, True), (0, 503, False), (3, 503, True)])
def test_a_stateful_set_probes_its_leader_alone(ordinal: int, status: int, passes: bool) -> None:
    [container] = children(wide_decode())[("StatefulSet", "llama-decode-g0")]["spec"]["template"]["spec"]["containers"]
    handler = type("Handler", (_Probe,), {"status": status})
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        command = list(container["readinessProbe"]["exec"]["command"])
        assert command[-1] == f"http://127.0.0.1:{cmd.METRICS_PORT}/readyz"
        command[-1] = f"http://127.0.0.1:{server.server_address[1]}/readyz"
        # The image's `python` is its venv's, as this test's is.
        ran = run_in_pod(command, f"llama-decode-g0-{ordinal}", f"{Path(sys.executable).parent}:/usr/bin:/bin")
        server.shutdown()
    assert (ran.returncode == 0) == passes, ran.stderr


def test_a_pod_groups_ranks_wait_out_the_kubelets_back_off_for_each_other() -> None:
    spec = parse_spec(wide_decode())
    decode, prefill = (cmd.worker_args(spec, role, "http://etcd:2379") for role in ("decode", "prefill"))
    window = ["--rendezvous-timeout", str(cmd.POD_GROUP_RENDEZVOUS_S)]
    assert any(decode[i : i + 2] == window for i in range(len(decode))) and "--rendezvous-timeout" not in prefill
    assert cmd.POD_GROUP_RENDEZVOUS_S > 300  # the kubelet's longest crash back-off
    body = wide_decode()
    body["spec"]["decode"]["engineArgs"] = {"rendezvousTimeout": "30m"}
    argv = cmd.worker_args(parse_spec(body), "decode", "http://etcd:2379")
    assert argv[len(argv) - 1 - argv[::-1].index("--rendezvous-timeout") + 1] == "30m"  # the last one wins
