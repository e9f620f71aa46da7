"""What scripts/k8s_scenarios.py drives a pdserve deployment on Kubernetes with: kubectl, the
official OpenAI SDK, ``pdserve workers`` and the workers' /metrics, each wait under a deadline.

Every check raises ``ScenarioFailed`` naming what broke; nothing here retries a failure away
except ``wait_for``, which polls a probe until its deadline.
"""

from __future__ import annotations

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

PROMPT = "The capital of France is"
MAX_TOKENS = 16
STREAM_TOKENS = 48
STREAMS = 8  # concurrent clients while a scenario changes the deployment
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
            try:
                with urllib.request.urlopen(f"http://{ip}:9090/metrics", timeout=5) as reply:
                    metrics = reply.read().decode()
            except OSError:  # a pod still starting: not settled yet
                return False
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


def served_requests(namespace: str, pod: str) -> float:
    """Requests the worker in ``pod`` has ended, by its /metrics (0 before it answers)."""
    address = get_json("pod", pod, "-n", namespace)["status"].get("podIP")
    if not address:
        return 0.0
    try:
        with urllib.request.urlopen(f"http://{address}:9090/metrics", timeout=5) as reply:
            metrics = reply.read().decode()
    except OSError:  # not listening yet
        return 0.0
    return sum(
        float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("pdserve_worker_requests_total{")
    )


def processes_left() -> list[str]:
    """pdserve's pod processes still running on this machine."""
    done = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    return [line for line in done.stdout.splitlines() if "/opt/pdserve/bin/pdserve" in line]


def make_secured_secrets(namespace: str, name: str, workdir: Path) -> tuple[str, Path, Path]:
    """The Secrets examples/secured.yaml names, less etcd's, made with openssl as its header
    says, in ``namespace`` for the deployment ``name``: (the API key, the API's certificate,
    the folder holding the cluster's ca.crt, tls.crt and tls.key)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=workdir, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2"]
    openssl("req", "-x509", *ec, "-subj", "/CN=pdserve cluster CA", "-keyout", "ca.key", "-out", "ca.crt")
    openssl("req", *ec, "-subj", "/CN=pdserve-cluster", "-keyout", "tls.key", "-out", "tls.csr")
    (workdir / "ext").write_text("subjectAltName=DNS:pdserve-cluster\nextendedKeyUsage=serverAuth,clientAuth\n")
    sign = ["-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2", "-extfile", "ext"]
    openssl("x509", "-req", "-in", "tls.csr", *sign, "-out", "tls.crt")
    host = f"{name}.{namespace}.svc"
    san = f"subjectAltName=DNS:{name},DNS:{host},DNS:{host}.cluster.local"
    openssl("req", "-x509", *ec, "-subj", f"/CN={host}", "-addext", san, "-keyout", "api.key", "-out", "api.crt")
    key = uuid.uuid4().hex
    ns = ["-n", namespace]
    kubectl(
        "create",
        "secret",
        "generic",
        f"{name}-cluster-tls",
        *ns,
        *(f"--from-file={workdir / f}" for f in ("ca.crt", "tls.crt", "tls.key")),
    )
    kubectl(
        "create", "secret", "tls", f"{name}-tls", *ns, f"--cert={workdir / 'api.crt'}", f"--key={workdir / 'api.key'}"
    )
    kubectl("create", "secret", "generic", f"{name}-api-keys", *ns, f"--from-literal=api-key={key}")
    return key, workdir / "api.crt", workdir


class Shared:
    """The deployment the scenarios share: made by the first that needs it, handed back to
    each next one with one decode replica and every worker registered."""

    def __init__(self, example: Path) -> None:
        self.example = example
        self.deployment: Deployment | None = None
        self.base_url = ""
        self.model = ""

    def get(self) -> Deployment:
        if self.deployment is None:
            self.deployment, self.base_url, self.model = start(self.example)
            return self.deployment
        self.deployment.scale("decode", 1)
        etcd_url = chart_etcd_url()
        wait_for(lambda: decode_pods_registered(self.deployment, etcd_url, 1), 600, "one decode worker again")
        return self.deployment

    def streams(self) -> Streams:
        return Streams(self.base_url, self.model, STREAMS)

    def close(self) -> None:
        if self.deployment is not None:
            self.deployment.close()
            self.deployment = None
