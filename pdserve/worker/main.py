"""Run one worker process: start its other ranks (if any), load the engine, start the role's
service, serve until stopped; or, as rank 1..N-1 of a group across hosts, follow its rank 0."""

from __future__ import annotations

import asyncio
import logging

import torch

from pdserve.distributed.errors import RankFailed
from pdserve.distributed.parallel_state import SINGLE_RANK
from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_loop import build_engine
from pdserve.observability import logs
from pdserve.worker.config import WorkerConfig
from pdserve.worker.data_parallel import serve_data_parallel
from pdserve.worker.follower import run_follower
from pdserve.worker.group.leader import WorkerGroup
from pdserve.worker.roles import SERVICES
from pdserve.worker.runtime import WorkerRuntime

logger = logging.getLogger(__name__)


def run(config: WorkerConfig) -> int:
    """The worker process's program: a rank of another host's group (``run_follower``), or a
    worker with its own ranks, if any (``serve``). Returns the exit status."""
    if config.placement is not None and not config.placement.is_leader:
        try:  # the rank's threads are the leader's, as for a child rank (run_rank)
            return run_follower(config)
        except RankFailed as error:
            logger.error("rank %d could not join its group: %s", config.placement.group_index, error)
            return 1
    return asyncio.run(serve(config))


async def serve(config: WorkerConfig) -> int:
    """Serve until SIGTERM, SIGINT or a Drain RPC, then drain and exit. Returns the exit
    status: 1 when the worker stopped because it could not serve (a rank or its engine died)."""
    logs.bind(worker_id=config.id)
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    if config.parallel.data_parallel_size > 1:
        return await serve_data_parallel(config)
    # Several ranks: they start (and load their shares) beside this process's own load.
    group = await WorkerGroup.start(config, config.id) if config.parallel.world_size > 1 else None
    try:
        parallel = SINGLE_RANK if group is None else group.state
        engine = await build_engine(lambda: LLMEngine(config.model, config.engine, parallel=parallel))
    except BaseException:
        if group is not None:
            await group.close(None)
        raise
    runtime = WorkerRuntime(config, engine, group)
    try:
        await runtime.start(SERVICES[config.role])
    except BaseException:
        await runtime.close()
        raise
    # One line a launcher (``pdserve up``) or an operator can wait for.
    print(f"pdserve {config.role} worker {runtime.worker_id} listening on {runtime.endpoint}", flush=True)
    await runtime.run()
    return 0 if runtime.failure is None else 1
