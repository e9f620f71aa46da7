"""Models' live knobs in etcd: ``Knobs`` as JSON at ``registry.knobs_key(model)``.

Written by the planner (each decision that retunes) and by operators (``pdserve knobs
set``); followed by the model's workers (their scheduler's budgets) and by every frontend
(the router's local-prefill threshold), which apply a change within about a second, without
a restart. No key means every component runs with its start-up settings.

A worker never goes above what it was started with: the engine reserved its memory for the
start-up batch and token budget (``WorkerEntry.max_num_seqs`` / ``max_num_batched_tokens``),
so the stored knobs are clamped to those. ``deployed_knobs`` gives what is in force when no
knobs are stored, which is where the planner and ``knobs set`` start from.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from urllib.parse import unquote

import aetcd
import msgspec

from pdserve.control_plane.frontend_stats import FrontendStats
from pdserve.control_plane.observation import Knobs
from pdserve.control_plane.registry import KNOBS_PREFIX, WorkerEntry, knobs_key

logger = logging.getLogger(__name__)


def decode_knobs(data: bytes | str) -> Knobs:
    """Parse a stored value; raises ValueError naming what is wrong."""
    try:
        return msgspec.json.decode(data, type=Knobs)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise ValueError(f"knobs do not decode: {error}") from None


async def get_knobs(client: aetcd.Client, model: str, timeout_s: float = 3.0) -> Knobs | None:
    """The model's stored knobs, or None when there are none.

    Raises ValueError naming the key when the stored value does not decode.
    """
    key = knobs_key(model)
    async with asyncio.timeout(timeout_s):
        kv = await client.get(key.encode())
    if kv is None:
        return None
    try:
        return decode_knobs(kv.value)
    except ValueError as error:
        raise ValueError(f"the value at {key}: {error}") from None


async def put_knobs(client: aetcd.Client, model: str, knobs: Knobs, timeout_s: float = 3.0) -> None:
    """Store ``knobs`` for ``model``, replacing what was there (the last writer wins)."""
    async with asyncio.timeout(timeout_s):
        await client.put(knobs_key(model).encode(), msgspec.json.encode(knobs))


async def delete_knobs(client: aetcd.Client, model: str, timeout_s: float = 3.0) -> bool:
    """Remove the model's knobs (back to start-up settings); False when there were none."""
    async with asyncio.timeout(timeout_s):
        return bool(await client.delete(knobs_key(model).encode()))


async def list_knobs(client: aetcd.Client, timeout_s: float = 3.0) -> dict[str, Knobs]:
    """Every model's stored knobs; values that do not decode are skipped with a warning."""
    async with asyncio.timeout(timeout_s):
        response = await client.get_prefix(KNOBS_PREFIX.encode())
    return parse_knobs(response)


def parse_knobs(
    kvs: Iterable[aetcd.rtypes.KeyValue], warned: set[tuple[bytes, int]] | None = None
) -> dict[str, Knobs]:
    """``{model: Knobs}`` from the key-values under ``KNOBS_PREFIX``; bad values are skipped
    with a warning, once per value when a ``warned`` set is kept between calls."""
    knobs = {}
    for kv in kvs:
        key = kv.key.decode(errors="replace")
        try:
            knobs[unquote(key.removeprefix(KNOBS_PREFIX))] = decode_knobs(kv.value)
        except ValueError as error:
            if warned is None or (kv.key, kv.mod_revision) not in warned:
                logger.warning("skipping %s: %s", key, error)
            if warned is not None:
                warned.add((kv.key, kv.mod_revision))
    return knobs


def deployed_knobs(model: str, workers: Sequence[WorkerEntry], frontends: Sequence[FrontendStats]) -> Knobs:
    """The knobs in force for ``model`` when none are stored: its workers' start-up budgets
    (the tightest of each pool) and its frontends' local-prefill threshold; ``Knobs()``'s
    defaults for whatever no live component reports."""
    default = Knobs()

    def tightest(role: str, limit: Callable[[WorkerEntry], int], fallback: int) -> int:
        return min((limit(w) for w in workers if w.model == model and w.role == role and limit(w)), default=fallback)

    seqs = tightest("decode", lambda w: w.max_num_seqs, default.decode_max_num_seqs)
    tokens = tightest("decode", lambda w: w.max_num_batched_tokens, default.decode_max_num_batched_tokens)
    thresholds = [f.local_prefill_tokens for f in frontends if f.local_prefill_tokens is not None]
    return Knobs(
        decode_max_num_seqs=seqs,
        decode_max_num_batched_tokens=max(seqs, tokens),
        prefill_chunk_size=tightest("prefill", lambda w: w.max_num_batched_tokens, default.prefill_chunk_size),
        local_prefill_threshold_tokens=min(thresholds, default=default.local_prefill_threshold_tokens),
    )
