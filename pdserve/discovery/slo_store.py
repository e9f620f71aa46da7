"""Models' SLO targets in etcd: ``SLOTargets`` as JSON at ``registry.slo_key(model)``.

Written by the CLI (``pdserve slo set``) and the operator, followed by the planner (by watch)
and read by ``pdserve status``. Every call runs under a deadline and raises one of ``etcd.ETCD_ERRORS``
when etcd fails. Writes are plain puts: the last writer wins (targets change by hand,
rarely).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import aetcd

from pdserve.discovery.registry import ROOT, slo_key
from pdserve.discovery.slo import SLOTargets

logger = logging.getLogger(__name__)

SLO_PREFIX = f"{ROOT}/slo/"


async def get_slo(client: aetcd.Client, model: str, timeout_s: float = 3.0) -> SLOTargets | None:
    """The model's stored targets, or None when there are none.

    Raises ValueError naming the key when the stored value does not decode, or is another
    model's (a writer that got the key wrong).
    """
    key = slo_key(model)
    async with asyncio.timeout(timeout_s):
        kv = await client.get(key.encode())
    if kv is None:
        return None
    try:
        targets = SLOTargets.decode(kv.value)
    except ValueError as error:
        raise ValueError(f"the value at {key}: {error}") from None
    if targets.model != model:
        raise ValueError(f"the value at {key} is for model {targets.model!r}, not {model!r}")
    return targets


async def put_slo(client: aetcd.Client, targets: SLOTargets, timeout_s: float = 3.0) -> None:
    """Store ``targets`` at ``slo_key(targets.model)``, replacing what was there."""
    async with asyncio.timeout(timeout_s):
        await client.put(slo_key(targets.model).encode(), targets.encode())


async def list_slos(client: aetcd.Client, timeout_s: float = 3.0) -> list[SLOTargets]:
    """Every model's stored targets, sorted by model; values that do not decode are skipped
    with a warning."""
    async with asyncio.timeout(timeout_s):
        response = await client.get_prefix(SLO_PREFIX.encode())
    return decode_slos(response)


def decode_slos(kvs: Iterable[aetcd.rtypes.KeyValue]) -> list[SLOTargets]:
    """The targets stored in ``kvs`` (key-values under ``SLO_PREFIX``), sorted by model; values
    that do not decode are skipped with a warning."""
    targets = []
    for kv in kvs:
        try:
            targets.append(SLOTargets.decode(kv.value))
        except ValueError as error:
            logger.warning("skipping %s: %s", kv.key.decode(errors="replace"), error)
    return sorted(targets, key=lambda t: t.model)


async def delete_slo(client: aetcd.Client, model: str, timeout_s: float = 3.0) -> bool:
    """Remove the model's targets; False when there were none."""
    async with asyncio.timeout(timeout_s):
        return bool(await client.delete(slo_key(model).encode()))
