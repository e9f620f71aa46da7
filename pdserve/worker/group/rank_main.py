"""The program of ranks 1..N-1 of a serving worker's group (``python -m pdserve.worker.group.rank_main``).

Like the engine's follower ranks (``pdserve.offline.rank_main``) it loads its share of the model
and runs every step rank 0 plans, on the main thread; beside that, a second thread runs its
``RankService``: a NIXL agent over its own KV cache, linked to rank 0 (``GroupLink``). When rank
0 stops the steps, the service is stopped too and the rank exits.
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
    """What rank 0 of a serving worker hands its other ranks."""

    model: str
    engine: EngineConfig
    role: Role
    model_name: str  # the served name: part of the KV layout peers check
    agent_name: str  # rank 0's; rank r's agent is "{agent_name}.rank{r}"
    link_host: str
    link_port: int
    transfer_timeout_s: float
    num_threads: int | None = None


def agent_name(rank0_name: str, rank: int) -> str:
    """The NIXL agent name of ``rank`` of the group whose rank 0 is ``rank0_name``."""
    return rank0_name if rank == 0 else f"{rank0_name}.rank{rank}"


def main(joined: tuple[RankStart, ParallelState] | None = None) -> int:
    """The rank's program: a child of rank 0, or (``joined``) a rank started on another host."""
    return run_rank(ServingRank, _run, logger=logger, joined=joined)


def _run(program: ServingRank, parallel: ParallelState) -> int:
    setup = setup_model(program.model, program.engine, parallel)
    num_blocks = parallel.plans.receive(GroupStart).num_blocks
    kv_cache = KVCache(setup.kv_spec, num_blocks, setup.device)
    layout = KVLayout.from_spec(
        setup.kv_spec, model=program.model_name, tp_size=parallel.tp_size, tp_rank=parallel.tp_rank
    )
    agent = KVAgent(agent_name(program.agent_name, parallel.rank), kv_cache, layout)
    service = RankService(
        parallel.rank,
        program.role,
        agent,
        (program.link_host, program.link_port),
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
        # Without its agent the rank cannot serve KV: rank 0 sees the link end (or never start)
        # and stops the worker, which ends this rank's steps too.
        logger.exception("rank %d: its KV service failed", service.rank)


if __name__ == "__main__":
    sys.exit(main())
