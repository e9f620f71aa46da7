"""One reconcile of one PDServeDeployment: read the world, compute the children, apply, report.

Level-triggered and idempotent: it runs on any event of the resource or its children and on a
periodic resync, always from scratch. It writes the children (server-side apply, so unchanged
children stay untouched), deletes the children a changed spec no longer wants, and rebuilds the
status from what it observed. The planner writes only ``spec.{prefill,decode}.replicas``; the
reconcile reads them like any other field, so it follows the planner instead of fighting it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from datetime import datetime, timezone
from typing import Any

from pdserve.operator import children as ch
from pdserve.operator.args import disaggregation, etcd_url
from pdserve.operator.etcd_secrets import etcd_auth
from pdserve.operator.kube import Kube, object_path
from pdserve.operator.registry import RegistryView, sync_registry
from pdserve.operator.spec import DeploymentSpec, SpecError, parse_spec
from pdserve.operator.status import Observed, build_status, invalid_status, service_endpoints

logger = logging.getLogger(__name__)

LWS_CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/leaderworkersets.leaderworkerset.x-k8s.io"


@dataclass(frozen=True)
class Settings:
    """What every reconcile of this operator shares."""

    default_etcd: str | None = None
    # Off in tests without etcd; on, the status counts registered workers and the SLO is mirrored.
    read_registry: bool = True
    # The ClusterRole that planners without a service account of their own are bound to.
    planner_cluster_role: str | None = None


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


async def reconcile(kube: Kube, namespace: str, name: str, settings: Settings) -> dict[str, Any] | None:
    """Bring ``namespace/name``'s children to its spec and write its status; the status
    written, or None when the resource is gone (its children are garbage-collected)."""
    path = object_path("PDServeDeployment", namespace, name)
    body = await asyncio.to_thread(kube.get, path)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    generation = body["metadata"].get("generation", 0)
    previous = body.get("status")
    try:
        spec = parse_spec(body)
        etcd = etcd_url(spec, settings.default_etcd)
        lws = await asyncio.to_thread(kube.get, LWS_CRD) is not None
        desired = ch.desired_children(spec, ch.Owner.of(body), etcd, lws, settings.planner_cluster_role)
    except (SpecError, ValueError) as error:
        status = invalid_status(generation, "InvalidSpec", str(error), previous, now())
        await _write_status(kube, path, previous, status)
        return status

    for obj in desired:
        await asyncio.to_thread(kube.apply, obj)
    await _prune(kube, namespace, name, desired, lws)

    observed = await _observe(kube, namespace, spec, desired, generation, body)
    if settings.read_registry:
        view = await _read_registry(kube, namespace, etcd, spec)
    else:
        view = RegistryView(None)
    observed = dataclasses.replace(observed, registered=view.registered, registry_error=view.error)
    status = build_status(observed, previous, now())
    await _write_status(kube, path, previous, status)
    return status


async def _read_registry(kube: Kube, namespace: str, url: str, spec: DeploymentSpec) -> RegistryView:
    """The registry as the deployment's own etcd credentials read it; a Secret the operator
    cannot read leaves the registry unread, saying why."""
    with tempfile.TemporaryDirectory(prefix="pdserve-etcd-") as directory:
        try:
            auth = await asyncio.to_thread(etcd_auth, kube, namespace, spec.etcd, Path(directory))
        except ValueError as error:
            return RegistryView(None, str(error))
        return await sync_registry(url, spec, auth)


async def _write_status(kube: Kube, path: str, previous: dict | None, status: dict[str, Any]) -> None:
    # A None is a field to remove (a merge patch's null); the stored status has no such key.
    if previous != _without_none(status):
        await asyncio.to_thread(kube.patch_status, path, status)


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return value


async def _prune(kube: Kube, namespace: str, name: str, wanted: list[dict[str, Any]], lws: bool) -> None:
    """Delete the children of this resource that the spec no longer asks for (a disabled
    planner, a pool moved between a Deployment and a kind for groups that span pods, a group
    scaled away with its Service), and a planner's ServiceAccount and RoleBinding once it is
    gone or runs under a service account of the spec's. LeaderWorkerSets only where that API is."""
    keep = {(o["kind"], o["metadata"]["name"]) for o in wanted}
    selector = f"{ch.DEPLOYMENT_LABEL}={name},{ch.MANAGED_BY}={ch.OPERATOR}"
    kinds = ["Deployment", "StatefulSet", "Service", "ServiceAccount", "RoleBinding"]
    kinds += ["LeaderWorkerSet"] if lws else []
    for kind in kinds:
        for obj in await asyncio.to_thread(kube.list, object_path(kind, namespace), selector):
            if (kind, obj["metadata"]["name"]) not in keep:
                logger.info(
                    "%s/%s: deleting %s %s, no longer in the spec", namespace, name, kind, obj["metadata"]["name"]
                )
                await asyncio.to_thread(kube.delete, object_path(kind, namespace, obj["metadata"]["name"]))


async def _observe(
    kube: Kube, namespace: str, spec: DeploymentSpec, desired: list[dict[str, Any]], generation: int, body: dict
) -> Observed:
    """Each component's replicas as its workloads report them. A pool's replicas are its
    groups: a Deployment's pods, a LeaderWorkerSet's groups, or its StatefulSets, each one group
    that counts ready (updated) once all its pods are."""
    wanted: dict[str, int] = {}
    ready: dict[str, int] = {}
    updated: dict[str, int] = {}
    stale: list[str] = []
    for obj in desired:
        if obj["kind"] not in ("Deployment", "LeaderWorkerSet", "StatefulSet"):
            continue
        component = obj["metadata"]["labels"][ch.COMPONENT_LABEL]
        live = await asyncio.to_thread(kube.get, object_path(obj["kind"], namespace, obj["metadata"]["name"]))
        live_status = (live or {}).get("status") or {}
        if obj["kind"] == "StatefulSet":
            size = obj["spec"]["replicas"]
            counts = (
                1,
                int(live_status.get("readyReplicas", 0) >= size),
                int(live_status.get("updatedReplicas", 0) >= size),
            )
        else:
            counts = (
                obj["spec"]["replicas"],
                live_status.get("readyReplicas", 0),
                live_status.get("updatedReplicas", 0),
            )
        for tally, count in zip((wanted, ready, updated), counts):
            tally[component] = tally.get(component, 0) + count
        # A LeaderWorkerSet's status has no observedGeneration.
        seen = live_status.get("observedGeneration", 0 if obj["kind"] != "LeaderWorkerSet" else None)
        if live is None or (seen is not None and seen < live["metadata"].get("generation", 0)):
            stale.append(component)
    # Endpoints only once the frontend Service is there: a client can reach nothing before.
    frontend = await asyncio.to_thread(kube.get, object_path("Service", namespace, body["metadata"]["name"]))
    endpoints = None if frontend is None else service_endpoints(frontend, spec.tls is not None)
    return Observed(
        generation=generation,
        desired=wanted,
        ready=ready,
        updated=updated,
        stale=stale,
        needs_prefill=disaggregation(spec) == "always",
        endpoints=endpoints,
    )


async def resync_all(kube: Kube, namespace: str | None) -> list[tuple[str, str]]:
    """Every PDServeDeployment in scope (``namespace``, or all of them), for the periodic resync."""
    path = object_path("PDServeDeployment", namespace)
    items = await asyncio.to_thread(kube.list, path)
    return [(i["metadata"]["namespace"], i["metadata"]["name"]) for i in items]
