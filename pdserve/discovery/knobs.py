"""Models' live knobs in etcd: ``Knobs`` as JSON at ``registry.knobs_key(model)``.

Written by the planner (each decision that retunes) and by operators (``pdserve knobs
set``); followed by the model's workers (their scheduler's budgets) and by every frontend
(the router's local-prefill threshold), which apply a change as their etcd watch brings it, without
a restart. No key means every component runs with its start-up settings.

A worker never goes above what it was started with: the engine reserved its memory for the
start-up batch and token budget (``WorkerEntry.max_num_seqs`` / ``max_num_batched_tokens``),
so the stored knobs are clamped to those. ``deployed_knobs`` gives what is in force when no
knobs are stored, which is where the planner and ``knobs set`` start from.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from urllib.parse import unquote

import aetcd
import msgspec

from pdserve.discovery.registry import KNOBS_PREFIX, knobs_key
from pdserve.types.engine_config import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, check_step_limits

logger = logging.getLogger(__name__)

# The router's start-up threshold (``RouterConfig.local_prefill_threshold_tokens``) as well.
LOCAL_PREFILL_THRESHOLD_TOKENS = 64


class Knobs(msgspec.Struct, frozen=True, kw_only=True):
    """Settings that trade TTFT against ITL without changing the number of GPUs.

    - ``decode_max_num_seqs``: most requests a decode worker runs at once; fewer keep each
      decode step short (ITL) while the rest wait for a slot.
    - ``decode_max_num_batched_tokens``: a decode worker's token budget per step; it bounds
      how much of a locally prefilled prompt rides along with the decodes in one step.
    - ``prefill_chunk_size``: a prefill worker's token budget per step (its chunked-prefill
      size); larger batches more prompts per step, amortising the step's fixed cost.
    - ``local_prefill_threshold_tokens``: the router prefills prompts shorter than this on
      the decode worker itself, skipping the prefill queue and the KV transfer; 0 sends
      every prompt to the prefill pool.

    The defaults are those a deployment starts with: the engine's and the router's.
    """

    decode_max_num_seqs: int = MAX_NUM_SEQS
    decode_max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    prefill_chunk_size: int = MAX_NUM_BATCHED_TOKENS
    local_prefill_threshold_tokens: int = LOCAL_PREFILL_THRESHOLD_TOKENS

    def __post_init__(self) -> None:
        check_step_limits(self.decode_max_num_seqs, self.decode_max_num_batched_tokens, prefix="decode_")
        if self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {self.prefill_chunk_size}")
        if self.local_prefill_threshold_tokens < 0:
            raise ValueError(f"local_prefill_threshold_tokens must be >= 0, got {self.local_prefill_threshold_tokens}")


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
    kvs: Iterable[aetcd.rtypes.KeyValue],
    warned: set[tuple[bytes, int]] | None = None,
    last: dict[str, Knobs] | None = None,
) -> dict[str, Knobs]:
    """``{model: Knobs}`` from the key-values under ``KNOBS_PREFIX``; bad values are skipped
    with a warning, once per value when a ``warned`` set is kept between calls. A reader that
    passes the ``last`` result keeps a model's knobs from it when its new value is bad, as
    the model's workers do."""
    knobs = {}
    for kv in kvs:
        key = kv.key.decode(errors="replace")
        model = unquote(key.removeprefix(KNOBS_PREFIX))
        try:
            knobs[model] = decode_knobs(kv.value)
        except ValueError as error:
            if warned is None or (kv.key, kv.mod_revision) not in warned:
                logger.warning("skipping %s: %s", key, error)
            if warned is not None:
                warned.add((kv.key, kv.mod_revision))
            if last is not None and model in last:
                knobs[model] = last[model]
    return knobs
