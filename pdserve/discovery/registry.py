"""The worker registry in etcd: who serves which model in which role, where, and how loaded.

Key layout (a contract: routers, the planner, the CLI and the operator read these keys)::

    /pdserve/v1/workers/{model}/{role}/{worker_id}   JSON WorkerEntry, under the worker's lease
    /pdserve/v1/slo/{model}                          JSON SLOTargets: the model's TTFT/ITL targets
    /pdserve/v1/planner/{model}                      JSON Decision: the planner's latest decision
    /pdserve/v1/frontends/{frontend_id}              JSON FrontendStats, under the frontend's lease
    /pdserve/v1/knobs/{model}                        JSON Knobs: live scheduler and router settings

Each ``{...}`` component is percent-encoded (``urllib.parse.quote(s, safe="")``), so a
Hugging Face model name such as ``org/name`` stays one path segment and no prefix of one
model's keys matches another model's. Values are JSON (msgspec); a reader skips, with a
warning, any value that does not decode, so one bad writer cannot take routing down.

A worker is live exactly as long as its lease: ``registration.WorkerRegistration`` keeps the lease
alive and rewrites the entry with fresh load about every second; a worker that stops
(crash, kill -9, lost network) vanishes from every reader within the lease's TTL.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Iterable
from urllib.parse import quote

import aetcd
import aetcd.rtypes
import msgspec

from pdserve.types.engine_load import EngineLoad

logger = logging.getLogger(__name__)

ROOT = "/pdserve/v1"
WORKERS_PREFIX = f"{ROOT}/workers/"
KNOBS_PREFIX = f"{ROOT}/knobs/"


class Role(enum.StrEnum):
    """What a worker does; the value is its key segment and its JSON value in etcd."""

    PREFILL = "prefill"
    DECODE = "decode"

    @classmethod
    def parse(cls, value: str) -> Role:
        """``value`` as a Role; a ValueError naming the roles for anything else."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"role must be one of {', '.join(cls)}, got {value!r}") from None


def _segment(name: str) -> str:
    return quote(name, safe="")


def worker_key(model: str, role: Role, worker_id: str) -> str:
    """The key of one worker's entry."""
    return f"{WORKERS_PREFIX}{_segment(model)}/{_segment(role)}/{_segment(worker_id)}"


def slo_key(model: str) -> str:
    """The key reserved for a model's latency targets."""
    return f"{ROOT}/slo/{_segment(model)}"


def planner_key(model: str) -> str:
    """The key reserved for the planner's decisions about a model."""
    return f"{ROOT}/planner/{_segment(model)}"


def knobs_key(model: str) -> str:
    """The key of a model's live knobs (``knobs_store``)."""
    return f"{KNOBS_PREFIX}{_segment(model)}"


def frontend_key(frontend_id: str) -> str:
    """The key reserved for a live frontend."""
    return f"{ROOT}/frontends/{_segment(frontend_id)}"


class WorkerEntry(msgspec.Struct, kw_only=True, frozen=True):
    """What a worker publishes about itself: identity, where to reach it, its KV geometry, its load."""

    worker_id: str
    role: Role
    model: str
    model_path: str
    endpoint: str  # host:port of the worker's gRPC service
    nixl: bytes  # opaque: the KV transfer agents' metadata (every rank's, in a group), for peers to load
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    max_num_seqs: int  # start-up limits: the most that live knobs can set
    max_num_batched_tokens: int = 0  # 0: not reported (an older worker)
    started_at: float  # unix seconds; tells a restarted worker from its earlier self
    metrics_port: int | None = None
    load: EngineLoad = EngineLoad()  # as the worker last reported it
    draining: bool = False  # a draining worker finishes what it has and must be sent nothing new
    updated_at: float = 0.0  # unix seconds, stamped by the registration at each write
    # The KV heads' spread, which routing checks before pairing a prefill and a decode worker:
    # the model's KV heads (0: MLA, whose latent every rank holds whole) over this many ranks.
    tensor_parallel_size: int = 1
    num_kv_heads: int = 0
    # The data-parallel group this worker is a rank of, which fails and restarts as a whole:
    # rank 0's worker id ("" for a worker of no such group, a tensor-parallel group included,
    # which registers once), how many ranks register in it, and this one's place among them.
    group_id: str = ""
    group_size: int = 1
    group_rank: int = 0

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "role", Role.parse(self.role))  # a str given in code becomes a Role
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if not 0 <= self.group_rank < self.group_size:
            raise ValueError(f"group_rank must be in [0, group_size={self.group_size}), got {self.group_rank}")
        if self.group_size > 1 and not self.group_id:
            raise ValueError(f"group_id must be set for a group of {self.group_size} ranks")

    @property
    def key(self) -> str:
        """Where this entry lives in etcd."""
        return worker_key(self.model, self.role, self.worker_id)


def encode_entry(entry: WorkerEntry) -> bytes:
    """The JSON value stored under ``entry.key``."""
    return msgspec.json.encode(entry)


def decode_entry(value: bytes) -> WorkerEntry:
    """Parse a stored value; raises msgspec.DecodeError (or ValidationError) when malformed."""
    return msgspec.json.decode(value, type=WorkerEntry)


def decode_entries(kvs: Iterable[aetcd.rtypes.KeyValue], warned: set[tuple[bytes, int]]) -> list[WorkerEntry]:
    """Decode every value, skipping bad ones with one warning per (key, revision) not in ``warned``."""
    entries = []
    for kv in kvs:
        try:
            entries.append(decode_entry(kv.value))
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            if (kv.key, kv.mod_revision) not in warned:
                warned.add((kv.key, kv.mod_revision))
                logger.warning(
                    "skipping registry value at %s that does not decode: %s",
                    kv.key.decode(errors="replace"),
                    exc,
                )
    return entries


async def list_workers(client: aetcd.Client, timeout_s: float = 3.0) -> list[WorkerEntry]:
    """Every registered worker, read once; raises one of ``ETCD_ERRORS`` if etcd fails."""
    async with asyncio.timeout(timeout_s):
        response = await client.get_prefix(WORKERS_PREFIX.encode())
    return decode_entries(response, set())
