"""Remove every PDServeDeployment in a scope and wait until nothing of them is left: what
``helm uninstall`` runs first (the chart's pre-delete hook, ``pdserve remove-deployments``),
while the operator and etcd still run, so each worker pod's preStop drain can finish.

Contract: ``remove_deployments`` returns once no PDServeDeployment is left in the scope and no
child of one it deleted (Deployment, StatefulSet, LeaderWorkerSet, Service, ConfigMap, pod) is left either;
it raises ``RemovalTimeout`` naming what is still there when its deadline passes first, and
``RemovalError`` at once when the API server refuses it a call (401, 403: its RBAC). It
deletes only the PDServeDeployments: their children go through the garbage collector (they
carry ownerReferences), and pods through their own graceful termination (preStop, then
``terminationGracePeriodSeconds``). Every API call runs under ``Kube``'s call deadline; a failed
call (an API server restarting) is reported and retried until the deadline. It re-lists each
poll, so a PDServeDeployment created meanwhile is deleted too. Each deletion and each change in
what it waits for is reported, one line each, for the hook Job's log.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from pdserve.extras import missing_extra

try:
    import urllib3
    from kubernetes.client.exceptions import ApiException
except ModuleNotFoundError as error:
    missing_extra(error, "k8s", "pdserve's operator")

from pdserve.operator.children import DEPLOYMENT_LABEL, MANAGED_BY, OPERATOR
from pdserve.operator.kube import Kube, object_path

POLL_S = 1.0
# While nothing changes, the wait is reported again this often.
REPORT_EVERY_S = 10.0
# Children the garbage collector removes after their PDServeDeployment, in the order reported.
CHILD_KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet", "Service", "ConfigMap", "Pod")
# What a call raises when no answer comes (refused, reset, past its deadline).
NO_ANSWER = (urllib3.exceptions.HTTPError, OSError, TimeoutError)


class RemovalError(Exception):
    """The removal cannot finish: a call it is not allowed to make (its RBAC), or its deadline."""


class RemovalTimeout(RemovalError):
    """The deadline passed with PDServeDeployments or their children still there."""


def _status_message(error: ApiException) -> str:
    if not error.body:
        return str(error.reason)
    try:
        return json.loads(error.body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(error.body)


def _scope(namespace: str | None) -> str:
    return f"namespace {namespace}" if namespace else "all namespaces"


def _list(kube: Kube, kind: str, namespace: str | None, selector: str | None = None) -> list[dict[str, Any]]:
    """The objects of ``kind``; none when the API is not served (no LeaderWorkerSet CRD)."""
    try:
        return kube.list(object_path(kind, namespace), selector)
    except ApiException as error:
        if error.status == 404:
            return []
        raise


def _describe(kind: str, obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    text = f"{kind} {meta.get('namespace')}/{meta['name']}"
    notes = []
    if kind == "Pod":
        notes.append((obj.get("status") or {}).get("phase", "Unknown"))
        if obj["spec"].get("nodeName"):
            notes.append(f"node {obj['spec']['nodeName']}")
    if meta.get("deletionTimestamp"):
        notes.append(f"deleting since {meta['deletionTimestamp']}")
    if meta.get("finalizers"):
        notes.append(f"finalizers {','.join(meta['finalizers'])}")
    return f"{text} ({', '.join(notes)})" if notes else text


def _leftovers(kube: Kube, deleted: set[tuple[str, str]]) -> list[str]:
    """What is still there of the PDServeDeployments in ``deleted``."""
    by_namespace: dict[str, list[str]] = {}
    for namespace, name in sorted(deleted):
        by_namespace.setdefault(namespace, []).append(name)
    left: list[str] = []
    for namespace, names in by_namespace.items():
        alive = {o["metadata"]["name"]: o for o in _list(kube, "PDServeDeployment", namespace)}
        left += [_describe("PDServeDeployment", alive[name]) for name in names if name in alive]
        selector = f"{MANAGED_BY}={OPERATOR},{DEPLOYMENT_LABEL} in ({','.join(names)})"
        for kind in CHILD_KINDS:
            left += [_describe(kind, obj) for obj in _list(kube, kind, namespace, selector)]
    return left


def remove_deployments(
    kube: Kube, namespace: str | None, timeout_s: float, report: Callable[[str], None]
) -> list[tuple[str, str]]:
    """Delete every PDServeDeployment in ``namespace`` (None: all) and wait until they and their
    children are gone; the (namespace, name) of each one deleted. ``report`` gets a line for each
    deletion and each change in what is left."""
    started = time.monotonic()
    deadline = started + timeout_s
    deleted: set[tuple[str, str]] = set()
    left: list[str] | None = None  # None until the API server first answers
    failure = ""
    last_report: tuple[list[str], float] | None = None
    report(f"removing every PDServeDeployment in {_scope(namespace)}; deadline {timeout_s:g} s")

    def say(line: str) -> None:
        report(f"[{time.monotonic() - started:6.1f}s] {line}")

    while True:
        try:
            for obj in _list(kube, "PDServeDeployment", namespace):
                key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
                if key not in deleted and not obj["metadata"].get("deletionTimestamp"):
                    say(f"deleting PDServeDeployment {key[0]}/{key[1]}")
                    kube.delete(object_path("PDServeDeployment", *key))
                deleted.add(key)
            left = _leftovers(kube, deleted)
        except ApiException as error:
            if error.status in (401, 403):  # no retry mends a missing permission
                raise RemovalError(f"{error.status} {error.reason}: {_status_message(error)}") from None
            failure = f"{error.status} {error.reason}"
            say(f"API call failed, retrying: {failure}")
        except NO_ANSWER as error:
            failure = f"{error.status} {error.reason}" if isinstance(error, ApiException) else repr(error)
            say(f"API call failed, retrying: {failure}")
        else:
            if not left:
                say(f"done: {len(deleted)} PDServeDeployment(s) and all their children are gone")
                return sorted(deleted)
            now = time.monotonic()
            if last_report is None or last_report[0] != left or now - last_report[1] >= REPORT_EVERY_S:
                say(f"waiting for {len(left)}: " + "; ".join(left))
                last_report = (left, now)
        if time.monotonic() >= deadline:
            if left is None:
                raise RemovalTimeout(f"after {timeout_s:g} s, the API server never answered (last: {failure})")
            raise RemovalTimeout(
                f"after {timeout_s:g} s, still there in {_scope(namespace)}: {'; '.join(left)}. A pod that stays "
                "is usually in its preStop drain (up to its terminationGracePeriodSeconds), held by a finalizer, "
                "or on a node that is gone (kubectl describe pod -n NAMESPACE NAME)"
            )
        time.sleep(POLL_S)
