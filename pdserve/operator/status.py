"""A PDServeDeployment's status, rebuilt from what was observed on each reconcile.

Nothing here remembers: the status is a function of the spec, the children the API server
reports and the workers registered in etcd. A condition keeps its ``lastTransitionTime``
while its status stays the same, so an unchanged world writes an identical status (and the
API server then records no change).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.operator.children import POOLS


@dataclass(frozen=True)
class Observed:
    """What one reconcile saw. ``registered`` is None when etcd could not be read."""

    generation: int
    desired: dict[str, int]  # component → replicas asked for
    ready: dict[str, int]  # component → ready replicas its workload reports
    updated: dict[str, int]  # component → replicas on the current pod template
    stale: list[str] = field(default_factory=list)  # workloads whose controller has not seen the latest spec
    registered: dict[str, int] | None = None  # role → workers serving (not draining) in etcd
    registry_error: str | None = None
    problems: list[tuple[str, str]] = field(default_factory=list)  # (reason, message) that degrade it


def condition(kind: str, ok: bool, reason: str, message: str, previous: list[dict], now: str) -> dict[str, str]:
    status = "True" if ok else "False"
    old = next((c for c in previous if c.get("type") == kind), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    return {"type": kind, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}


def build_status(observed: Observed, previous: dict[str, Any] | None, now: str) -> dict[str, Any]:
    """The status subresource's content."""
    old_conditions = (previous or {}).get("conditions") or []
    status: dict[str, Any] = {"observedGeneration": observed.generation}
    for component in (*POOLS, "frontend"):
        desired = observed.desired.get(component, 0)
        ready = observed.ready.get(component, 0)
        entry: dict[str, Any] = {"desired": desired, "ready": ready, "readyOfDesired": f"{ready}/{desired}"}
        if component in POOLS:  # None (unknown: etcd unreadable) removes a stale count
            entry["registered"] = None if observed.registered is None else observed.registered.get(component, 0)
        status[component] = entry

    unavailable = [c for c in (*POOLS, "frontend") if observed.desired.get(c, 0) > 0 and observed.ready.get(c, 0) < 1]
    if unavailable:
        available = condition(
            "Available",
            False,
            "ComponentsUnavailable",
            f"no ready replica yet: {', '.join(unavailable)}",
            old_conditions,
            now,
        )
    else:
        available = condition(
            "Available",
            True,
            "MinimumReplicasAvailable",
            "the frontend and every pool with replicas have a ready replica",
            old_conditions,
            now,
        )

    moving = []
    for component, desired in observed.desired.items():
        ready, updated = observed.ready.get(component, 0), observed.updated.get(component, 0)
        if component in observed.stale or updated < desired or ready != desired:
            moving.append(f"{component} {ready}/{desired} ready, {updated} updated")
    if moving:
        progressing = condition("Progressing", True, "RollingOut", "; ".join(moving), old_conditions, now)
    else:
        progressing = condition(
            "Progressing", False, "Settled", "every component runs its desired replicas", old_conditions, now
        )

    problems = list(observed.problems)
    if observed.registry_error is not None:
        problems.append(("RegistryUnreachable", observed.registry_error))
    if problems:
        degraded = condition("Degraded", True, problems[0][0], "; ".join(m for _, m in problems), old_conditions, now)
    else:
        degraded = condition("Degraded", False, "AsExpected", "no problem observed", old_conditions, now)
    status["conditions"] = [available, progressing, degraded]
    return status


def invalid_status(generation: int, reason: str, message: str, previous: dict[str, Any] | None, now: str) -> dict:
    """The status of a resource whose spec cannot be deployed: Degraded, with the field named."""
    old = (previous or {}).get("conditions") or []
    return {
        "observedGeneration": generation,
        "conditions": [
            condition("Available", False, reason, "the spec cannot be deployed", old, now),
            condition("Progressing", False, reason, "waiting for a valid spec", old, now),
            condition("Degraded", True, reason, message, old, now),
        ],
    }
