"""Pools whose worker group spans pods: a LeaderWorkerSet, else a StatefulSet and a headless
Service per group.

Contract: a multi-pod group runs one rank a pod, rank i in the pod of index i (0: the leader),
each pod asking for the GPUs of one rank. One rank a pod because a rank is one ``pdserve
prefill|decode`` process that learns its index from its pod (``--group-index`` or
``LWS_WORKER_INDEX``); ``gpusPerNode`` ranks a pod would need a worker that starts some ranks
as local children and meets the others over the network, which it does not. The cost: ranks on
one node talk through the network stack, not NVLink or shared memory (pods do not share an IPC
namespace), so a group should be no larger than its model needs.

- With LeaderWorkerSet (``leader_worker_set``): one LWS per pool, a group per replica, ``size``
  pods; LWS sets ``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE`` and ``LWS_WORKER_INDEX`` in its pods,
  creates the followers once the leader exists (``startupPolicy: LeaderCreated``) and recreates
  the whole group when any of its pods restarts (``RecreateGroupOnPodRestart``).
- Without it (``stateful_set``, ``headless_service``): one StatefulSet per group, named
  ``POOL-gI``, with a headless Service of the same name, so pod ``POOL-gI-R`` is
  ``POOL-gI-R.POOL-gI.NAMESPACE.svc`` (through the pod's DNS search path, whatever the cluster's
  domain). Every pod gets ``--leader-address POOL-gI-0...:29500 --group-size N``; its index comes
  from its name (``${POD_NAME##*-}``, a shell wrapper: v1.20 has no pod-index label or env).
  The Service publishes not-ready pods: the ranks must resolve the leader before any of them is
  ready. ``podManagementPolicy: Parallel`` creates a group's pods at once.

Probes: only the leader's worker is known to serve the metrics port (``/readyz``, ``/livez``), so
the leader alone is probed: in an LWS the leader template has the probes and the worker template
none; a StatefulSet has one template, so its probes run ``/readyz`` and ``/livez`` on ordinal 0
and pass at once elsewhere. A follower's health is the group's: a rank that loses its group
exits non-zero, so every rank restarts.

Not guaranteed, by either kind without a gang scheduler: that a group's pods are scheduled
together (a group may hold some nodes' GPUs while the rest of its pods stay Pending); that a
StatefulSet group restarts as one (its ranks exit together, and the kubelet restarts each
container in place with its own back-off); that a template change restarts a StatefulSet group
once (the controller replaces its pods one at a time, highest ordinal first, and each
replacement fails the group); that a TP follower outlives its leader's preStop drain.
"""

from __future__ import annotations

import copy
from typing import Any

from pdserve.operator import args as cmd

GROUP_LABEL = "pdserve.io/group"
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
# A StatefulSet pod's index is its name's last part; Kubernetes sets $POD_NAME (downward API).
_IS_FOLLOWER = 'test "${POD_NAME##*-}" != 0'
_GET = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=4)"


def group_name(pool_name: str, index: int) -> str:
    """The StatefulSet and headless Service of group ``index`` of the pool ``pool_name``."""
    return f"{pool_name}-g{index}"


def leader_host(name: str, namespace: str) -> str:
    """Ordinal 0 of group StatefulSet ``name``, through its headless Service's DNS."""
    return f"{name}-0.{name}.{namespace}.svc"


def _rendezvous(template: dict[str, Any]) -> dict[str, Any]:
    """``template`` with the leader's rendezvous port declared (every rank runs the same image)."""
    template = copy.deepcopy(template)
    container = template["spec"]["containers"][0]
    container["ports"].append({"name": "rendezvous", "containerPort": cmd.RENDEZVOUS_PORT, "protocol": "TCP"})
    return template


def leader_worker_set(meta: dict[str, Any], replicas: int, size: int, template: dict[str, Any]) -> dict[str, Any]:
    """``replicas`` groups of ``size`` pods; the leader is probed, its followers are not."""
    leader = _rendezvous(template)
    worker = copy.deepcopy(leader)
    for probe in PROBES:
        worker["spec"]["containers"][0].pop(probe, None)
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": meta,
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


def _leader_only(probe: dict[str, Any]) -> dict[str, Any]:
    """An HTTP probe as a command that only ordinal 0 runs (it passes on the others)."""
    action = probe["httpGet"]
    url = f"http://127.0.0.1:{action['port']}{action['path']}"
    script = f'{_IS_FOLLOWER} || exec python -c "$1" "$2"'
    timing = {k: v for k, v in probe.items() if k != "httpGet"}
    return {"exec": {"command": ["sh", "-c", script, "probe", _GET, url]}, **timing}


def stateful_set(
    meta: dict[str, Any], selector: dict[str, str], size: int, template: dict[str, Any], namespace: str
) -> dict[str, Any]:
    """One group: ``size`` pods, ordinal 0 the leader. ``meta``, ``selector`` and the template's
    labels carry the group's label, so no two groups' StatefulSets select each other's pods."""
    template = _rendezvous(template)
    container = template["spec"]["containers"][0]
    for probe in PROBES:
        if probe in container:
            container[probe] = _leader_only(container[probe])
    name = meta["name"]
    container["command"] = ["sh", "-c", 'exec pdserve "$@" --group-index "${POD_NAME##*-}"', "pdserve"]
    container["args"] = container["args"] + cmd.group_args(leader_host(name, namespace), size)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta,
        "spec": {
            "replicas": size,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            "template": template,
        },
    }


def headless_service(meta: dict[str, Any], selector: dict[str, str]) -> dict[str, Any]:
    """The DNS domain of one group's pods; not-ready ones included (the leader must resolve first)."""
    port = {"name": "rendezvous", "port": cmd.RENDEZVOUS_PORT, "targetPort": "rendezvous", "protocol": "TCP"}
    body = {"clusterIP": "None", "publishNotReadyAddresses": True, "ports": [port], "selector": selector}
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": body}
