"""Run one worker process: load the engine, start the role's service, serve until stopped."""

from __future__ import annotations

import logging

import torch

from pdserve.discovery.registry import Role
from pdserve.engine.engine import LLMEngine
from pdserve.worker.config import WorkerConfig
from pdserve.worker.decode import DecodeService
from pdserve.worker.prefill import PrefillService
from pdserve.worker.runtime import WorkerRuntime

logger = logging.getLogger(__name__)

SERVICES = {Role.PREFILL: PrefillService, Role.DECODE: DecodeService}


async def serve(config: WorkerConfig) -> None:
    """Serve until SIGTERM, SIGINT or a Drain RPC, then drain and exit."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    engine = LLMEngine(config.model, config.engine)
    runtime = WorkerRuntime(config, engine)
    try:
        await runtime.start(SERVICES[config.role])
    except BaseException:
        await runtime.close()
        raise
    # One line a launcher (``pdserve up``) or an operator can wait for.
    print(f"pdserve {config.role} worker {runtime.worker_id} listening on {runtime.endpoint}", flush=True)
    await runtime.run()
