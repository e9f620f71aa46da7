"""Scenarios that check a pdserve deployment on a real Kubernetes cluster, end to end.

Run it where the cluster's Services are reachable, with KUBECONFIG set and kubectl on PATH,
against a cluster where the chart is installed (operator and etcd). On the one-node test cluster:

    bash scripts/k8s_cluster.sh exec .venv/bin/python scripts/k8s_scenarios.py serve scale kill-decode

Each scenario applies charts/pdserve/examples/default-model.yaml (or --example) in a namespace
of its own, drives it with kubectl and the official OpenAI SDK, and deletes the namespace
afterwards. It raises on the first broken promise; with --json the last line is one JSON
object: each scenario's timings in seconds.

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
- uninstall (destructive: run it last): ``helm uninstall`` with a deployment serving leaves no
  pdserve object but the CRD, and no pdserve process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pdserve.model.default_model import default_model_path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "charts" / "pdserve" / "examples" / "default-model.yaml"
PROMPT = "The capital of France is"
MAX_TOKENS = 16
STREAM_TOKENS = 48
RELEASE = ["pdserve", "pdserve"]  # the chart's release and its namespace (--release, --release-namespace)
T = TypeVar("T")


class ScenarioFailed(AssertionError):
    pass


def kubectl(*args: str, stdin: str | None = None, timeout_s: float = 60) -> str:
    done = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise ScenarioFailed(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def get_json(*args: str) -> Any:
    return json.loads(kubectl("get", *args, "-o", "json"))


def wait_for(probe: Callable[[], T], timeout_s: float, what: str, interval_s: float = 1.0) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ScenarioFailed(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


class Deployment:
    """One PDServeDeployment in a namespace of its own, deleted (with the namespace) on close."""

    def __init__(self, example: Path, namespace: str | None = None) -> None:
        self.namespace = namespace or f"pdserve-e2e-{uuid.uuid4().hex[:6]}"
        self.body = yaml.safe_load(example.read_text())
        self.name = self.body["metadata"]["name"]
        self.own_namespace = namespace is None
        if self.own_namespace:
            kubectl("create", "namespace", self.namespace)

    def apply(self) -> None:
        kubectl("apply", "-n", self.namespace, "-f", "-", stdin=yaml.safe_dump(self.body))

    def status(self) -> dict[str, Any]:
        return get_json("pdservedeployment", self.name, "-n", self.namespace).get("status") or {}

    def available(self) -> dict[str, Any] | None:
        status = self.status()
        conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
        return status if conditions.get("Available") == "True" and status.get("endpoints") else None

    def pods(self, component: str) -> list[dict[str, Any]]:
        selector = f"pdserve.io/deployment={self.name},app.kubernetes.io/component={component}"
        return get_json("pods", "-n", self.namespace, "-l", selector)["items"]

    def registered(self, pool: str) -> int:
        return (self.status().get(pool) or {}).get("registered") or 0

    def scale(self, pool: str, replicas: int) -> None:
        patch = json.dumps({"spec": {pool: {"replicas": replicas}}})
        kubectl("patch", "pdservedeployment", self.name, "-n", self.namespace, "--type", "merge", "-p", patch)

    def close(self) -> None:
        if self.own_namespace:
            kubectl("delete", "namespace", self.namespace, "--wait=true", timeout_s=300)
        else:
            kubectl("delete", "pdservedeployment", self.name, "-n", self.namespace, "--ignore-not-found", timeout_s=300)


def all_ready(pods: list[dict[str, Any]]) -> bool:
    def ready(pod: dict[str, Any]) -> bool:
        conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}
        return pod["status"].get("phase") == "Running" and conditions.get("Ready") == "True"

    return bool(pods) and all(ready(pod) for pod in pods)


def offline_greedy(model_path: str) -> dict[str, Any]:
    """The offline engine's greedy completion of PROMPT, in a process of its own."""
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "generate", "--model", model_path, "--prompt", PROMPT]
        + ["--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


class Streams:
    """``count`` clients, each streaming completions one after another until stopped."""

    def __init__(self, base_url: str, model: str, count: int) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=base_url, api_key="none", timeout=300, max_retries=0)
        self.model = model
        self.done = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int) -> None:
        while not self._stop.is_set():
            try:
                text, finish = "", None
                stream = self.client.completions.create(
                    model=self.model,
                    prompt=f"{index}: Once upon a time",
                    max_tokens=STREAM_TOKENS,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for chunk in stream:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                if finish != "length":
                    raise ScenarioFailed(f"stream {index} ended with finish_reason={finish!r}")
                with self._lock:
                    self.done += 1
            except Exception as error:
                with self._lock:
                    self.errors.append(f"stream {index}: {type(error).__name__}: {error}")

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=600)
        if self.errors:
            raise ScenarioFailed(f"{len(self.errors)} requests failed: {self.errors[:3]}")
        if not self.done:
            raise ScenarioFailed("no stream completed")


def first_token_s(base_url: str, model: str, since: float) -> float:
    """Seconds from ``since`` to the first streamed token of a completion (retried until one comes)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", timeout=60, max_retries=0)

    def attempt() -> float | None:
        try:
            for _chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=1, stream=True):
                return time.monotonic() - since
        except Exception:
            return None
        return None

    return wait_for(attempt, 300, "a first token through the frontend")


def kv_settled(deployment: Deployment) -> bool:
    """Every worker reports no block referenced and no request held for a pull."""
    for pool in ("prefill", "decode"):
        for pod in deployment.pods(pool):
            ip = pod["status"].get("podIP")
            if not ip:
                return False
            with urllib.request.urlopen(f"http://{ip}:9090/metrics", timeout=5) as reply:
                metrics = reply.read().decode()
            for line in metrics.splitlines():
                if line.startswith(("pdserve_kv_blocks_used{", "pdserve_held_requests{")) and float(line.split()[-1]):
                    return False
    return True


def chart_etcd_url() -> str:
    """The chart's etcd, by its Service."""
    services = get_json("services", "-A", "-l", "app.kubernetes.io/component=etcd")["items"]
    if len(services) != 1:
        raise ScenarioFailed(f"expected the chart's one etcd Service, found {len(services)}")
    meta = services[0]["metadata"]
    return f"http://{meta['name']}.{meta['namespace']}.svc:2379"


def registered_workers(etcd_url: str) -> list[dict[str, Any]]:
    """The workers registered in the etcd at ``etcd_url`` (none if it cannot be read)."""
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "workers", "--etcd", etcd_url, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(done.stdout) if done.returncode == 0 else []


def registered_roles(etcd_url: str) -> set[str]:
    return {worker["role"] for worker in registered_workers(etcd_url)}


def decode_pods_registered(deployment: Deployment, etcd_url: str, count: int) -> bool:
    """``count`` decode pods, all Ready, each registered under its own name, and no other."""
    pods = {p["metadata"]["name"] for p in deployment.pods("decode") if all_ready([p])}
    workers = {w["worker_id"] for w in registered_workers(etcd_url) if w["role"] == "decode"}
    return len(pods) == count and pods == workers


def serve(example: Path) -> dict[str, float]:
    deployment = Deployment(example)
    try:
        started = time.monotonic()
        deployment.apply()
        status = wait_for(deployment.available, 900, "the deployment to be Available")
        available_s = time.monotonic() - started
        base_url, grpc_target = status["endpoints"]["openai"], status["endpoints"]["grpc"]
        model = served_name(deployment)
        first_s = first_token_s(base_url, model, started)
        for component in ("prefill", "decode", "frontend"):
            if not all_ready(deployment.pods(component)):
                raise ScenarioFailed(f"the {component} pods are not all Running and Ready")
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
        return {"apply_to_available_s": round(available_s, 1), "apply_to_first_token_s": round(first_s, 1)}
    finally:
        deployment.close()


def served_name(deployment: Deployment) -> str:
    name = deployment.body["spec"]["model"].get("name")
    if not name:
        raise ScenarioFailed("the example must name its served model (spec.model.name)")
    return name


def start(
    example: Path, edit: Callable[[dict[str, Any]], None] | None = None, namespace: str | None = None
) -> tuple[Deployment, str, str]:
    """The example applied (after ``edit`` of its spec), Available, and through its first token."""
    deployment = Deployment(example, namespace)
    if edit is not None:
        edit(deployment.body["spec"])
    deployment.apply()
    status = wait_for(deployment.available, 900, "the deployment to be Available")
    model = served_name(deployment)
    first_token_s(status["endpoints"]["openai"], model, time.monotonic())
    return deployment, status["endpoints"]["openai"], model


def scale(example: Path) -> dict[str, float]:
    deployment, base_url, model = start(example)
    try:
        streams = Streams(base_url, model, 8)
        time.sleep(5)
        asked = time.monotonic()
        deployment.scale("decode", 2)
        wait_for(lambda: deployment.registered("decode") == 2, 600, "a second decode worker to register")
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
    finally:
        deployment.close()


def kill_decode(example: Path) -> dict[str, float]:
    deployment, base_url, model = start(example)
    try:
        deployment.scale("decode", 2)
        wait_for(lambda: deployment.registered("decode") == 2, 600, "a second decode worker to register")
        streams = Streams(base_url, model, 8)
        time.sleep(8)
        victim = deployment.pods("decode")[0]["metadata"]["name"]
        killed = time.monotonic()
        kubectl("delete", "pod", victim, "-n", deployment.namespace, "--grace-period=0", "--force")
        etcd_url = chart_etcd_url()
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
    finally:
        deployment.close()


def roll(example: Path) -> dict[str, float]:
    deployment, base_url, model = start(example)
    try:
        old = {p["metadata"]["name"] for p in deployment.pods("decode")}
        streams = Streams(base_url, model, 8)
        time.sleep(5)
        asked = time.monotonic()
        args = deployment.body["spec"]["decode"].setdefault("engineArgs", {})
        args["maxNumSeqs"] = int(args.get("maxNumSeqs", 8)) + 1
        deployment.apply()

        def rolled() -> bool:
            pods = deployment.pods("decode")
            return bool(pods) and not old & {p["metadata"]["name"] for p in pods} and all_ready(pods)

        wait_for(rolled, 900, "the decode pool to roll onto the new engineArgs")
        wait_for(lambda: deployment.registered("decode") == 1, 300, "the new decode worker to register")
        rolled_s = time.monotonic() - asked
        time.sleep(5)
        streams.stop()
        wait_for(lambda: kv_settled(deployment), 60, "every KV block to be released")
        return {"rolled_s": round(rolled_s, 1), "streams_done": streams.done}
    finally:
        deployment.close()


def etcd_restart(example: Path) -> dict[str, float]:
    """The chart's etcd pod is deleted: its data goes with it (an emptyDir), so every worker
    must register again once it is back, and serving must not stop meanwhile."""
    deployment, base_url, model = start(example)
    try:
        streams = Streams(base_url, model, 8)
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
    finally:
        deployment.close()


def served_requests(pod: dict[str, Any]) -> float:
    """Requests a worker pod has ended, by its /metrics."""
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:9090/metrics", timeout=5) as reply:
        metrics = reply.read().decode()
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("pdserve_requests_total{"))


def planner(example: Path) -> dict[str, float]:
    """The planner, given an ITL target that one decode worker holds when idle (84 ms a step in
    the default model's profile) but not under 8 streams (113 ms), raises decode to 2."""

    def with_planner(spec: dict[str, Any]) -> None:
        spec["planner"] = {"enabled": True, "interval": "10s"}
        spec["slo"] = {"ttftP90": "10s", "itlP90": "100ms", "maxPrefillReplicas": 1, "maxDecodeReplicas": 2}

    deployment, base_url, model = start(example, with_planner)
    try:

        def desired_decode() -> int:
            spec = get_json("pdservedeployment", deployment.name, "-n", deployment.namespace)["spec"]
            return spec["decode"]["replicas"]

        wait_for(lambda: all_ready(deployment.pods("planner")), 300, "the planner pod to be Ready")
        time.sleep(30)
        if desired_decode() != 1:
            raise ScenarioFailed(f"the planner scaled an idle deployment to {desired_decode()} decode replicas")
        before = {p["metadata"]["name"] for p in deployment.pods("decode")}
        streams = Streams(base_url, model, 8)
        loaded = time.monotonic()
        wait_for(lambda: desired_decode() == 2, 600, "the planner to raise decode replicas to 2")
        decided_s = time.monotonic() - loaded
        wait_for(lambda: deployment.registered("decode") == 2, 600, "the new decode worker to register")
        serving_s = time.monotonic() - loaded
        (new,) = [p for p in deployment.pods("decode") if p["metadata"]["name"] not in before]
        wait_for(lambda: served_requests(new) > 0, 300, "the new decode pod to serve a request")
        streams.stop()
        return {"load_to_decision_s": round(decided_s, 1), "load_to_new_worker_s": round(serving_s, 1)}
    finally:
        deployment.close()


def processes_left() -> list[str]:
    """pdserve's pod processes still running on this machine."""
    done = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    return [line for line in done.stdout.splitlines() if "/opt/pdserve/bin/pdserve" in line]


def uninstall(example: Path) -> dict[str, float]:
    """DESTRUCTIVE: ``helm uninstall`` of the chart's release (--release, --release-namespace)
    with a deployment serving: nothing of pdserve stays but the CRD."""
    deployment, _base_url, _model = start(example)
    started = time.monotonic()
    done = subprocess.run(
        ["helm", "uninstall", RELEASE[0], "-n", RELEASE[1], "--wait", "--timeout", "5m"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    if done.returncode != 0:
        raise ScenarioFailed(f"helm uninstall: {done.stderr.strip()}")
    uninstall_s = time.monotonic() - started
    left = get_json("pdservedeployments", "-A")["items"]
    if left:
        raise ScenarioFailed(f"PDServeDeployments left: {[d['metadata']['name'] for d in left]}")
    selector = "app.kubernetes.io/name=pdserve"
    wait_for(lambda: not get_json("all", "-A", "-l", selector)["items"], 120, "every pdserve object to go")
    wait_for(lambda: not processes_left(), 60, f"pdserve's processes to end: {processes_left()}")
    kubectl("delete", "namespace", deployment.namespace, "--wait=true", timeout_s=300)
    return {"uninstall_s": round(uninstall_s, 1)}


SCENARIOS: dict[str, Callable[[Path], dict[str, float]]] = {
    "serve": serve,
    "scale": scale,
    "kill-decode": kill_decode,
    "roll": roll,
    "etcd-restart": etcd_restart,
    "planner": planner,
    "uninstall": uninstall,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS), help="scenarios to run, in order")
    parser.add_argument("--example", type=Path, default=EXAMPLE, help="the PDServeDeployment to apply")
    parser.add_argument("--json", action="store_true", help="print the timings as one JSON object last")
    parser.add_argument("--release", default=RELEASE[0], help="the chart's Helm release (default: pdserve)")
    parser.add_argument("--release-namespace", default=RELEASE[1], help="its namespace (default: pdserve)")
    args = parser.parse_args()
    RELEASE[:] = [args.release, args.release_namespace]
    results: dict[str, Any] = {}
    for name in args.scenarios:
        started = time.monotonic()
        print(f"k8s_scenarios: {name} ...", file=sys.stderr, flush=True)
        results[name] = SCENARIOS[name](args.example)
        results[name]["total_s"] = round(time.monotonic() - started, 1)
        print(f"k8s_scenarios: {name} passed: {results[name]}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
