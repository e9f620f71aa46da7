"""A PDServeDeployment's status, rebuilt from what was observed on each reconcile.

Nothing here remembers: the status is a function of the spec, the children the API server
reports and the workers registered in etcd. A condition keeps its ``lastTransitionTime``
while its status stays the same, so an unchanged world writes an identical status (and the
API server then records no change).

``Available`` means the deployment serves: the frontend has a ready replica and etcd lists a
decode worker serving the model (registered, not draining), and a prefill worker too when the
frontend's disaggregation mode is ``always`` (``conditional`` and ``off`` prefill on the
decode worker when no prefill worker is there; ``frontend/router.py``). A ready pod alone is
not enough: a worker's pod turns ready when its port opens, and it serves only once it has
registered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.operator.children import POOLS


@dataclass(frozen=True)
class Observed:
    """What one reconcile saw. ``registered`` is None when etcd could not be read."""

    generation: int
    desired: dict[str, int]  # component → replicas asked for (a pool's: its groups)
    ready: dict[str, int]  # component → ready replicas its workloads report (a group: all its pods ready)
    updated: dict[str, int]  # component → replicas on the current pod template
    stale: list[str] = field(default_factory=list)  # workloads whose controller has not seen the latest spec
    registered: dict[str, int] | None = None  # role → workers serving (not draining) in etcd
    registry_error: str | None = None
    needs_prefill: bool = False  # the frontend routes every prompt through a prefill worker
    endpoints: dict[str, str] | None = None  # service_endpoints of the frontend Service; None: not there yet


def service_endpoints(service: dict[str, Any], tls: bool) -> dict[str, str]:
    """Where clients in the cluster reach the frontend Service: ``openai``, the OpenAI API's
    base URL, and ``grpc``, ``host:port``; the host is the Service's cluster DNS name."""
    meta = service["metadata"]
    host = f"{meta['name']}.{meta['namespace']}.svc"
    ports = {p.get("name"): p["port"] for p in service["spec"]["ports"]}
    scheme = "https" if tls else "http"
    return {"openai": f"{scheme}://{host}:{ports['http']}/v1", "grpc": f"{host}:{ports['grpc']}"}


def condition(kind: str, ok: bool, reason: str, message: str, previous: list[dict], now: str) -> dict[str, str]:
    status = "True" if ok else "False"
    old = next((c for c in previous if c.get("type") == kind), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    return {"type": kind, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}


def available(observed: Observed, previous: list[dict], now: str) -> dict[str, str]:
    """The ``Available`` condition: whether the deployment serves (the module's docstring).

    With etcd unreadable it is False (``RegistryUnreachable``), not the last value seen: the
    status stays a function of what this reconcile observed, and an outage that outlasts the
    last good read would otherwise show as serving for as long as it lasts."""
    frontend_ready = observed.ready.get("frontend", 0) >= 1
    missing = [] if frontend_ready else ["the frontend has no ready replica"]
    if observed.registered is None:
        why = observed.registry_error or "the registry is not read"
        message = "; ".join([*missing, f"cannot tell whether workers serve: {why}"])
        return condition("Available", False, "RegistryUnreachable", message, previous, now)
    roles = ("prefill", "decode") if observed.needs_prefill else ("decode",)
    missing += [f"no {role} worker serves in etcd" for role in roles if observed.registered.get(role, 0) < 1]
    if missing:
        reason = "FrontendUnavailable" if not frontend_ready else "NoServingWorkers"
        return condition("Available", False, reason, "; ".join(missing), previous, now)
    serving = " and ".join(f"{role} workers" for role in roles)
    message = f"the frontend has a ready replica and {serving} serve"
    return condition("Available", True, "Serving", message, previous, now)


def build_status(observed: Observed, previous: dict[str, Any] | None, now: str) -> dict[str, Any]:
    """The status subresource's content."""
    old_conditions = (previous or {}).get("conditions") or []
    status: dict[str, Any] = {"observedGeneration": observed.generation}
    status["endpoints"] = observed.endpoints  # None removes those of a Service now gone
    for component in (*POOLS, "frontend"):
        desired = observed.desired.get(component, 0)
        ready = observed.ready.get(component, 0)
        entry: dict[str, Any] = {"desired": desired, "ready": ready, "readyOfDesired": f"{ready}/{desired}"}
        if component in POOLS:  # None (unknown: etcd unreadable) removes a stale count
            entry["registered"] = None if observed.registered is None else observed.registered.get(component, 0)
        status[component] = entry

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

    if observed.registry_error is not None:
        degraded = condition("Degraded", True, "RegistryUnreachable", observed.registry_error, old_conditions, now)
    else:
        degraded = condition("Degraded", False, "AsExpected", "no problem observed", old_conditions, now)
    status["conditions"] = [available(observed, old_conditions, now), progressing, degraded]
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
