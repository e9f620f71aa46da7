"""The program of tensor-parallel ranks 1..N-1 of a serving worker (``python -m pdserve.worker.group.rank_main``).

Like the engine's follower ranks (``pdserve.offline.rank_main``) it loads its share of the model
and runs every step its leader plans, on the main thread; beside that, a second thread runs its
``RankService``: a NIXL agent over its own KV cache, linked to the leader (``GroupLink``), whose
address comes first on the plan channel (``LinkAddress``). When the leader stops the steps, the
service is stopped too and the rank exits. The leader is rank 0, or in a group of data-parallel
ranks each rank's own (``pdserve.worker.data_parallel`` runs ``serve_follower`` there).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading

import msgspec

from pdserve.discovery.registry import Role
from pdserve.distributed.parallel_state import ParallelState
from pdserve.distributed.rank_group import RankStart
from pdserve.distributed.rank_program import run_rank
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.step_plan import GroupStart
from pdserve.kvtransfer import KVAgent, KVLayout
from pdserve.model.kv_cache import KVCache
from pdserve.model.setup import setup_model
from pdserve.types.engine_config import EngineConfig
from pdserve.worker.group.rank_service import RankService

logger = logging.getLogger("pdserve.worker.rank")

# After the last step: how long the KV thread may take to close its agent.
_STOP_GRACE_S = 10.0


class ServingRank(msgspec.Struct, frozen=True, kw_only=True):
    """What a serving worker's rank 0 hands its other ranks."""

    model: str
    engine: EngineConfig
    role: Role
    model_name: str  # the served name: part of the KV layout peers check
    transfer_timeout_s: float
    loopback_only: bool  # the worker is reached at a loopback address: its agents listen there alone
    num_threads: int | None = None


class LinkAddress(msgspec.Struct, frozen=True, kw_only=True):
    """A leader's first message on the plan channel: where its ``GroupLink`` listens, and its
    agent's name (tensor-parallel rank r's agent is ``agent_name(name, r)``)."""

    host: str
    port: int
    agent_name: str


def agent_name(leader_name: str, tp_rank: int) -> str:
    """The NIXL agent name of ``tp_rank`` of the ranks whose leader's agent is ``leader_name``."""
    return leader_name if tp_rank == 0 else f"{leader_name}.rank{tp_rank}"


def main(joined: tuple[RankStart, ParallelState] | None = None) -> int:
    """The rank's program: a child of rank 0, or (``joined``) a rank started on another host."""
    return run_rank(ServingRank, serve_follower, logger=logger, joined=joined)


def serve_follower(program: ServingRank, parallel: ParallelState) -> int:
    """Follow this rank's leader's steps and serve its KV until the leader stops the steps."""
    link = parallel.plans.receive(LinkAddress)
    setup = setup_model(program.model, program.engine, parallel)
    num_blocks = parallel.plans.receive(GroupStart).num_blocks
    kv_cache = KVCache(setup.kv_spec, num_blocks, setup.device)
    layout = KVLayout.from_spec(
        setup.kv_spec, model=program.model_name, tp_size=parallel.tp_size, tp_rank=parallel.tp_rank
    )
    agent = KVAgent(
        agent_name(link.agent_name, parallel.tp_rank), kv_cache, layout, loopback_only=program.loopback_only
    )
    service = RankService(
        parallel.tp_rank,
        program.role,
        agent,
        (link.host, link.port),
        transfer_timeout_s=program.transfer_timeout_s,
        connect_timeout_s=parallel.config.rendezvous_timeout_s,
    )
    thread = threading.Thread(target=_run_service, args=(service,), name="kv", daemon=True)
    thread.start()
    try:
        ModelRunner(setup.model, kv_cache, None, setup.device, parallel).follow()
    finally:
        service.stop()
        thread.join(_STOP_GRACE_S)
    return 0


def _run_service(service: RankService) -> None:
    try:
        asyncio.run(service.run())
    except Exception:
        # Without its agent the rank cannot serve KV: the leader sees the link end (or never start)
        # and stops the worker, which ends this rank's steps too.
        logger.exception("rank %d: its KV service failed", service.rank)


if __name__ == "__main__":
    sys.exit(main())
