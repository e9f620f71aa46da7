"""What the operator reads from and writes to a deployment's etcd: the workers registered
(for the status) and the SLO targets (mirrored from ``spec.slo`` for the planner)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pdserve.discovery.etcd import ETCD_ERRORS, RegistryUnavailable, close_quietly, connect
from pdserve.discovery.etcd_auth import EtcdAuth
from pdserve.discovery.registry import Role, list_workers
from pdserve.discovery.slo import SLOTargets
from pdserve.types.duration import parse_duration
from pdserve.discovery.slo_store import get_slo, put_slo
from pdserve.operator.spec import DeploymentSpec

ETCD_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class RegistryView:
    """Workers serving (registered, not draining) per role; ``error`` when etcd could not be read."""

    registered: dict[str, int] | None
    error: str | None = None


def slo_targets(spec: DeploymentSpec) -> SLOTargets | None:
    """``spec.slo`` as the planner's targets; None when it names no latency targets."""
    slo = spec.slo
    if slo.ttft_p90 is None or slo.itl_p90 is None:
        return None
    try:
        return SLOTargets(
            model=spec.model.served_name,
            ttft_p90_s=parse_duration(slo.ttft_p90),
            itl_p90_s=parse_duration(slo.itl_p90),
            e2e_p90_s=parse_duration(slo.e2e_p90) if slo.e2e_p90 else None,
            min_prefill_replicas=slo.min_prefill_replicas,
            max_prefill_replicas=slo.max_prefill_replicas,
            min_decode_replicas=slo.min_decode_replicas,
            max_decode_replicas=slo.max_decode_replicas,
        )
    except ValueError as error:
        raise ValueError(f"spec.slo: {error}") from None


async def sync_registry(url: str, spec: DeploymentSpec, auth: EtcdAuth = EtcdAuth()) -> RegistryView:
    """Count the model's workers and store its SLO targets when they changed, as ``auth``'s
    user; never raises for an unreachable etcd (the status says so instead)."""
    try:
        client = await connect(url, ETCD_TIMEOUT_S, auth)
    except (RegistryUnavailable, ValueError) as error:
        return RegistryView(None, str(error))
    try:
        model = spec.model.served_name
        workers = await list_workers(client, ETCD_TIMEOUT_S)
        counts = {role.value: 0 for role in Role}
        for entry in workers:
            if entry.model == model and not entry.draining:
                counts[entry.role.value] += 1
        targets = slo_targets(spec)
        if targets is not None and await get_slo(client, model, ETCD_TIMEOUT_S) != targets:
            await put_slo(client, targets, ETCD_TIMEOUT_S)
        return RegistryView(counts)
    except ETCD_ERRORS + (asyncio.TimeoutError,) as error:
        return RegistryView(None, f"etcd at {url}: {error or 'no answer'}")
    finally:
        await close_quietly(client)
