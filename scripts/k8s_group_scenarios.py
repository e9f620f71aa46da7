"""A worker group whose ranks are pods, on a real Kubernetes cluster (k8s_scenarios.py's ``group``).

The default model (SmolLM2-135M: 9 query heads over 3 KV heads) with its decode pool as a
tensor-parallel group of 3 ranks on "nodes" of 1 GPU (``gpusPerNode: 1``), so the operator runs
the group as 3 pods: without LeaderWorkerSet, a StatefulSet and a headless Service, each pod one
``pdserve decode`` rank finding rank 0 at its pod's DNS name. The group must serve the offline
engine's greedy tokens; then one follower pod is deleted with --grace-period=0 --force: the
group fails as a whole (rank 0 leaves the registry), its pods restart, and it serves again.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import yaml
from k8s_e2e import (
    MAX_TOKENS,
    PROMPT,
    Deployment,
    ScenarioFailed,
    all_ready,
    chart_etcd_url,
    get_json,
    kubectl,
    offline_greedy,
    registered_workers,
    served_name,
    wait_for,
)

from pdserve.model.default_model import default_model_path

RANKS = 3


def group_example(example: Path, directory: Path) -> Path:
    """``example`` with its decode pool a group of RANKS pods, written into ``directory``."""
    body: dict[str, Any] = copy.deepcopy(yaml.safe_load(example.read_text()))
    body["metadata"]["name"] = "group-model"
    body["spec"]["decode"]["tensorParallelSize"] = RANKS
    body["spec"]["decode"]["gpusPerNode"] = 1
    path = directory / "group-model.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _completion(base_url: str, model: str) -> str | None:
    """The greedy completion of PROMPT, or None while the deployment cannot serve it yet."""
    from openai import APIError, OpenAI

    client = OpenAI(base_url=base_url, api_key="none", timeout=120, max_retries=0)
    try:
        completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    except APIError:
        return None
    return completion.choices[0].text


def _decode_group_registered(etcd_url: str) -> bool:
    return any(w["role"] == "decode" and w.get("tensor_parallel_size") == RANKS for w in registered_workers(etcd_url))


def group(example: Path, workdir: Path) -> dict[str, float]:
    deployment = Deployment(group_example(example, workdir))
    try:
        started = time.monotonic()
        deployment.apply()
        status = wait_for(deployment.available, 900, "the group deployment to be Available")
        available_s = time.monotonic() - started
        sets = get_json("statefulsets", "-n", deployment.namespace)["items"]
        if [s["spec"]["replicas"] for s in sets] != [RANKS]:
            raise ScenarioFailed(
                f"expected one StatefulSet of {RANKS} pods, got {[s['metadata']['name'] for s in sets]}"
            )
        pods = deployment.pods("decode")
        if len(pods) != RANKS:
            raise ScenarioFailed(f"expected {RANKS} decode pods, got {[p['metadata']['name'] for p in pods]}")
        # Available comes from the registry; the leader pod's readiness probe follows within its period.
        leader = [p for p in pods if p["metadata"]["name"].endswith("-0")]
        wait_for(
            lambda: all_ready([p for p in deployment.pods("decode") if p["metadata"]["name"].endswith("-0")]),
            120,
            "the group's leader pod to be Ready",
        )
        base_url, model = status["endpoints"]["openai"], served_name(deployment)
        reference = offline_greedy(str(default_model_path()))["text"]
        text = wait_for(lambda: _completion(base_url, model), 120, "a completion through the group")
        if text != reference:
            raise ScenarioFailed(f"the group served {text!r}, the offline engine {reference!r}")
        etcd_url = chart_etcd_url()
        if not _decode_group_registered(etcd_url):
            raise ScenarioFailed(f"no decode worker of {RANKS} ranks registered: {registered_workers(etcd_url)}")
        follower = sorted(p["metadata"]["name"] for p in pods if p not in leader)[-1]
        killed = time.monotonic()
        kubectl("delete", "pod", follower, "-n", deployment.namespace, "--grace-period=0", "--force")
        wait_for(lambda: not _decode_group_registered(etcd_url), 120, "the group to leave the registry")
        failed_s = time.monotonic() - killed
        wait_for(lambda: _decode_group_registered(etcd_url), 900, "the group to register again")
        back_s = time.monotonic() - killed
        text = wait_for(lambda: _completion(base_url, model), 120, "a completion through the group again")
        if text != reference:
            raise ScenarioFailed(f"the group served {text!r} after its restart, the offline engine {reference!r}")
        return {
            "apply_to_available_s": round(available_s, 1),
            "group_failed_s": round(failed_s, 1),
            "group_back_s": round(back_s, 1),
        }
    finally:
        deployment.close()
