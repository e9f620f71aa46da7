"""Scenarios that check a pdserve deployment on a real Kubernetes cluster, end to end.

Run it where the cluster's Services are reachable, with KUBECONFIG set and kubectl on PATH,
against a cluster where the chart is installed (operator and etcd). On the one-node test cluster:

    bash scripts/k8s_cluster.sh exec .venv/bin/python scripts/k8s_scenarios.py serve scale kill-decode

The scenarios share one deployment of charts/pdserve/examples/default-model.yaml (or
--example) in a namespace of their own, each leaving it as it found it (one decode replica,
every worker registered); planner applies its own. The namespace is deleted at the end. It
raises on the first broken promise; with --json the last line is one JSON object: each
scenario's timings in seconds.

- serve: every pod Running and Ready; the OpenAI SDK and ``pdserve generate --target`` through
  the frontend get the offline engine's greedy tokens. Times apply → Available and → first token.
- scale: decode 1 → 2 → 1 while 8 streams run: no request fails, the new worker serves, the
  removed pod drains (its preStop) and no KV block stays held. Times both steps.
- kill-decode: with 2 decode pods, one is deleted with --grace-period=0 --force mid-stream:
  the streams migrate, a new pod registers, no request fails and no block leaks.
- roll: an ``engineArgs`` change rolls the decode pool while 8 streams run: no request fails.
- etcd-restart: the chart's etcd pod is deleted while 8 streams run: no request fails, and
  the workers register again in the new etcd.
- planner: with the planner on and an ITL target one idle decode worker holds, 8 streams make
  the planner raise decode to 2, and the new pod serves. Times load → decision → new worker.
- secured: examples/secured.yaml (on the chart's etcd): the API serves HTTPS with the key and
  refuses a wrong one; a worker accepts only clients with a cluster certificate.
- uninstall (destructive: run it last): ``helm uninstall`` with a deployment serving leaves no
  pdserve object but the CRD, and no pdserve process.
- namespaced (after uninstall): the chart again with its operator watching only its namespace
  (namespace-scoped RBAC): a deployment there serves, one elsewhere is left alone.
- group: the decode pool as a tensor-parallel group of 3 pods (a StatefulSet, k8s_group_scenarios.py)
  serves the offline engine's greedy tokens, fails as a whole when a follower pod is deleted,
  and serves again once its pods are back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k8s_chart_scenarios import RELEASE, namespaced, secured, uninstall
from k8s_group_scenarios import group
from k8s_e2e import (
    STREAMS,
    Shared,
    MAX_TOKENS,
    PROMPT,
    Deployment,
    ScenarioFailed,
    Streams,
    all_ready,
    chart_etcd_url,
    decode_pods_registered,
    first_token_s,
    get_json,
    kubectl,
    kv_settled,
    offline_greedy,
    registered_roles,
    served_name,
    served_requests,
    start,
    wait_for,
)

from pdserve.model.default_model import default_model_path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "charts" / "pdserve" / "examples" / "default-model.yaml"


def serve(shared: Shared) -> dict[str, float]:
    deployment = Deployment(shared.example)
    started = time.monotonic()
    deployment.apply()
    status = wait_for(deployment.available, 900, "the deployment to be Available")
    available_s = time.monotonic() - started
    base_url, grpc_target = status["endpoints"]["openai"], status["endpoints"]["grpc"]
    model = served_name(deployment)
    first_s = first_token_s(base_url, model, started)
    shared.deployment, shared.base_url, shared.model = deployment, base_url, model
    # Available needs a serving decode worker; a prefill worker may still be warming up.
    components = ("prefill", "decode", "frontend")
    wait_for(lambda: all(all_ready(deployment.pods(c)) for c in components), 300, "every pod Running and Ready")
    all_ready_s = time.monotonic() - started
    from openai import OpenAI

    reference = offline_greedy(str(default_model_path()))
    client = OpenAI(base_url=base_url, api_key="none", timeout=120, max_retries=0)
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    if completion.choices[0].text != reference["text"]:
        raise ScenarioFailed(f"OpenAI SDK: {completion.choices[0].text!r} != offline {reference['text']!r}")
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "generate", "--target", grpc_target, "--prompt", PROMPT]
        + ["--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--json", "--model-name", model],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise ScenarioFailed(f"pdserve generate --target {grpc_target}: {done.stderr.strip()[-500:]}")
    remote = json.loads(done.stdout.strip().splitlines()[-1])
    if remote["token_ids"] != reference["token_ids"]:
        raise ScenarioFailed(f"pdserve generate: {remote['token_ids']} != offline {reference['token_ids']}")
    return {
        "apply_to_available_s": round(available_s, 1),
        "apply_to_first_token_s": round(first_s, 1),
        "apply_to_all_ready_s": round(all_ready_s, 1),
    }


def scale(shared: Shared) -> dict[str, float]:
    deployment = shared.get()
    etcd_url = chart_etcd_url()
    streams = shared.streams()
    time.sleep(5)
    asked = time.monotonic()
    deployment.scale("decode", 2)
    wait_for(lambda: decode_pods_registered(deployment, etcd_url, 2), 600, "a second decode worker to register")
    scale_up_s = time.monotonic() - asked
    time.sleep(10)  # the new worker takes streams
    asked = time.monotonic()
    deployment.scale("decode", 1)
    wait_for(lambda: len(deployment.pods("decode")) == 1, 600, "the removed decode pod to go")
    drain_s = time.monotonic() - asked
    time.sleep(5)
    streams.stop()
    wait_for(lambda: kv_settled(deployment), 60, "every KV block to be released")
    return {"scale_up_s": round(scale_up_s, 1), "drain_s": round(drain_s, 1), "streams_done": streams.done}


def kill_decode(shared: Shared) -> dict[str, float]:
    deployment = shared.get()
    etcd_url = chart_etcd_url()
    deployment.scale("decode", 2)
    wait_for(lambda: decode_pods_registered(deployment, etcd_url, 2), 600, "a second decode worker to register")
    streams = shared.streams()
    time.sleep(8)
    victim = deployment.pods("decode")[0]["metadata"]["name"]
    killed = time.monotonic()
    kubectl("delete", "pod", victim, "-n", deployment.namespace, "--grace-period=0", "--force")
    wait_for(
        lambda: decode_pods_registered(deployment, etcd_url, 2),
        600,
        "a new decode worker to replace the deleted one (and the dead one's lease to end)",
    )
    replaced_s = time.monotonic() - killed
    time.sleep(5)
    streams.stop()
    wait_for(lambda: kv_settled(deployment), 60, "every KV block to be released")
    return {"replaced_s": round(replaced_s, 1), "streams_done": streams.done}


def roll(shared: Shared) -> dict[str, float]:
    deployment = shared.get()
    etcd_url = chart_etcd_url()
    old = {p["metadata"]["name"] for p in deployment.pods("decode")}
    streams = shared.streams()
    time.sleep(5)
    asked = time.monotonic()
    args = deployment.body["spec"]["decode"].setdefault("engineArgs", {})
    args["maxNumSeqs"] = int(args.get("maxNumSeqs", 8)) + 1
    deployment.apply()

    def rolled() -> bool:
        names = {p["metadata"]["name"] for p in deployment.pods("decode")}
        return not old & names and decode_pods_registered(deployment, etcd_url, 1)

    wait_for(rolled, 900, "the decode pool to roll onto the new engineArgs")
    rolled_s = time.monotonic() - asked
    time.sleep(5)
    streams.stop()
    wait_for(lambda: kv_settled(deployment), 60, "every KV block to be released")
    return {"rolled_s": round(rolled_s, 1), "streams_done": streams.done}


def etcd_restart(shared: Shared) -> dict[str, float]:
    """The chart's etcd pod is deleted: its data goes with it (an emptyDir), so every worker
    must register again once it is back, and serving must not stop meanwhile."""
    shared.get()
    streams = shared.streams()
    time.sleep(5)
    pods = get_json("pods", "-A", "-l", "app.kubernetes.io/component=etcd")["items"]
    if len(pods) != 1:
        raise ScenarioFailed(f"expected the chart's one etcd pod, found {len(pods)}")
    etcd = pods[0]["metadata"]
    url = chart_etcd_url()
    killed = time.monotonic()
    kubectl("delete", "pod", etcd["name"], "-n", etcd["namespace"], "--wait=false")

    def new_etcd_ready() -> bool:
        pods = get_json("pods", "-n", etcd["namespace"], "-l", "app.kubernetes.io/component=etcd")["items"]
        return all_ready(pods) and pods[0]["metadata"]["uid"] != etcd["uid"]

    wait_for(new_etcd_ready, 300, "the etcd pod to come back")
    wait_for(lambda: registered_roles(url) >= {"prefill", "decode"}, 300, "the workers to register again")
    back_s = time.monotonic() - killed
    time.sleep(5)
    streams.stop()
    return {"registered_again_s": round(back_s, 1), "streams_done": streams.done}


def planner(shared: Shared) -> dict[str, float]:
    """The planner, given an ITL target that one decode worker holds when idle (84 ms a step in
    the default model's profile) but not under 8 streams (113 ms), raises decode to 2."""

    def with_planner(spec: dict[str, Any]) -> None:
        spec["planner"] = {"enabled": True, "interval": "10s"}
        spec["slo"] = {"ttftP90": "10s", "itlP90": "100ms", "maxPrefillReplicas": 1, "maxDecodeReplicas": 2}

    deployment, base_url, model = start(shared.example, with_planner)
    try:

        def desired_decode() -> int:
            spec = get_json("pdservedeployment", deployment.name, "-n", deployment.namespace)["spec"]
            return spec["decode"]["replicas"]

        wait_for(lambda: all_ready(deployment.pods("planner")), 300, "the planner pod to be Ready")
        time.sleep(30)
        if desired_decode() != 1:
            raise ScenarioFailed(f"the planner scaled an idle deployment to {desired_decode()} decode replicas")
        before = {p["metadata"]["name"] for p in deployment.pods("decode")}
        streams = Streams(base_url, model, STREAMS)
        loaded = time.monotonic()
        wait_for(lambda: desired_decode() == 2, 600, "the planner to raise decode replicas to 2")
        decided_s = time.monotonic() - loaded
        wait_for(lambda: deployment.registered("decode") == 2, 600, "the new decode worker to register")
        serving_s = time.monotonic() - loaded
        (new,) = [p["metadata"]["name"] for p in deployment.pods("decode") if p["metadata"]["name"] not in before]
        wait_for(lambda: served_requests(deployment.namespace, new) > 0, 300, "the new decode pod to serve a request")
        streams.stop()
        return {"load_to_decision_s": round(decided_s, 1), "load_to_new_worker_s": round(serving_s, 1)}
    finally:
        deployment.close()


SCENARIOS: dict[str, Callable[[Shared], dict[str, float]]] = {
    "serve": serve,
    "scale": scale,
    "kill-decode": kill_decode,
    "roll": roll,
    "etcd-restart": etcd_restart,
    "planner": planner,
    "secured": secured,
    "uninstall": uninstall,
    "namespaced": namespaced,
    "group": lambda shared: group(shared.example, Path(tempfile.mkdtemp(prefix="pdserve-group-"))),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="+", choices=list(SCENARIOS), help="scenarios to run, in order")
    parser.add_argument("--example", type=Path, default=EXAMPLE, help="the PDServeDeployment to apply")
    parser.add_argument("--json", action="store_true", help="print the timings as one JSON object last")
    parser.add_argument("--release", default=RELEASE[0], help="the chart's Helm release (default: pdserve)")
    parser.add_argument("--release-namespace", default=RELEASE[1], help="its namespace (default: pdserve)")
    args = parser.parse_args()
    RELEASE[:] = [args.release, args.release_namespace]
    shared = Shared(args.example)
    results: dict[str, Any] = {}
    try:
        for name in args.scenarios:
            started = time.monotonic()
            print(f"k8s_scenarios: {name} ...", file=sys.stderr, flush=True)
            results[name] = SCENARIOS[name](shared)
            results[name]["total_s"] = round(time.monotonic() - started, 1)
            print(f"k8s_scenarios: {name} passed: {results[name]}", file=sys.stderr, flush=True)
    finally:
        shared.close()
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
