"""Run one worker process: start its other ranks (if any), load the engine, start the role's
service, serve until stopped."""

from __future__ import annotations

import logging

import torch

from pdserve.distributed.parallel_state import SINGLE_RANK
from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_loop import build_engine
from pdserve.worker.config import WorkerConfig
from pdserve.worker.data_parallel import serve_data_parallel
from pdserve.worker.group.leader import WorkerGroup
from pdserve.worker.roles import SERVICES
from pdserve.worker.runtime import WorkerRuntime

logger = logging.getLogger(__name__)


async def serve(config: WorkerConfig) -> int:
    """Serve until SIGTERM, SIGINT or a Drain RPC, then drain and exit. Returns the exit
    status: 1 when the worker stopped because it could not serve (a rank or its engine died)."""
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
