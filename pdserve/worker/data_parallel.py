"""A worker of data-parallel attention ranks (DeepSeek-class models with expert parallelism).

Each rank is a worker of its own: its engine (its own scheduler and KV cache), NIXL agent, gRPC
server and registry entry — rank 0 under the worker's id, rank r as ``{worker_id}-dp{r}``, each
entry naming the group (``group_id``: rank 0's id; ``group_size``, ``group_rank``).
Routers choose among them as among any workers of the pool, which is what data-parallel
attention is: each rank attends over its own requests, but treat the group as one failure
domain (``pdserve.frontend.groups``). What makes them one group is the experts: every rank
holds a share of each MoE layer's, and their engines step together (``EngineLoop``'s
lockstep) so that each step's all-to-all has every rank.

With tensor parallelism inside each data-parallel rank (TP x DP ranks), rank r is
tensor-parallel rank ``r % tp`` of data-parallel rank ``r // tp``: the worker is that DP rank's
TP rank 0, which leads its other TP ranks as a tensor-parallel worker leads its group
(``pdserve.worker.group.leader.WorkerGroup.lead``), and those run ``serve_follower``.

Rank 0 (the worker process) starts ranks 1..N-1 (``python -m pdserve.worker.data_parallel``),
or with a placement meets ranks started on other hosts (``pdserve.worker.follower``), and they
meet within the rendezvous deadline. A stop (SIGTERM, Drain) reaching rank 0 is passed
on to the others, and the engines leave their lockstep together. A rank that dies fails its
peers' next step: every rank then leaves the registry and exits with status 1, and the
supervisor starts the group again (ranks also exit when rank 0 does).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable

import msgspec

from pdserve.distributed.parallel_state import ParallelState
from pdserve.distributed.rank_group import RankStart, start_group
from pdserve.distributed.rank_program import run_rank
from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_loop import build_engine
from pdserve.worker.config import WorkerConfig
from pdserve.worker.group.leader import WorkerGroup, serving_rank
from pdserve.worker.group.rank_main import serve_follower
from pdserve.worker.roles import SERVICES
from pdserve.worker.runtime import WorkerRuntime

logger = logging.getLogger(__name__)

# A rank here is a worker: it logs as a worker process does.
_WORKER_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class DataParallelStart(msgspec.Struct, frozen=True):
    """What rank 0 hands the other ranks: the group's configuration, its worker id fixed."""

    config: WorkerConfig

    @property
    def num_threads(self) -> int | None:
        return self.config.num_threads


def rank_config(config: WorkerConfig, dp_rank: int) -> WorkerConfig:
    """Data-parallel rank ``dp_rank``'s own worker configuration: its id, and ports of its own."""
    if dp_rank == 0:
        return config
    return msgspec.structs.replace(
        config, worker_id=f"{config.id}-dp{dp_rank}", port=0, metrics_port=None if config.metrics_port is None else 0
    )


async def serve_data_parallel(config: WorkerConfig) -> int:
    """Rank 0: start the other ranks, serve as a worker beside them, stop them with it."""
    config = msgspec.structs.replace(config, worker_id=config.id)  # one id for the group, this pid's
    payload = msgspec.msgpack.encode(DataParallelStart(config))
    # Synchronous on purpose: the rendezvous binds this thread to its device (CUDA).
    ranks = start_group(
        config.parallel, __name__, payload, config.engine.device, config.placement, config.reachable_host
    )
    assert ranks is not None and ranks.state is not None
    try:
        return await serve_rank(config, ranks.state, config.id, announce=True, on_stop=ranks.stop_ranks)
    finally:
        await asyncio.to_thread(ranks.close, config.drain_timeout_s + 10)


async def serve_rank(
    config: WorkerConfig,
    parallel: ParallelState,
    group_id: str,
    *,
    announce: bool,
    on_stop: Callable[[], None] | None = None,
) -> int:
    """One data-parallel rank's worker of the group whose rank 0 is ``group_id``, until it
    stops; its exit status (1: it could not serve)."""
    ranks = await WorkerGroup.lead(config, parallel, config.id) if parallel.tp_size > 1 else None
    try:
        engine = await build_engine(lambda: LLMEngine(config.model, config.engine, parallel=parallel))
    except BaseException:
        if ranks is not None:
            await ranks.close(None)
        raise
    runtime = WorkerRuntime(config, engine, ranks, data_parallel_id=group_id)
    try:
        await runtime.start(SERVICES[config.role])
    except BaseException:
        await runtime.close()
        raise
    if announce:  # one line a launcher (``pdserve up``) or an operator can wait for
        print(f"pdserve {config.role} worker {runtime.worker_id} listening on {runtime.endpoint}", flush=True)
    if on_stop is not None:
        runtime.on_stop = on_stop
    await runtime.run()
    return 0 if runtime.failure is None else 1


def main(joined: tuple[RankStart, ParallelState] | None = None, own: WorkerConfig | None = None) -> int:
    """Ranks 1..D-1's program: a child of rank 0, or (``joined``) a rank started on another host,
    which serves at its ``own`` configuration's addresses rather than rank 0's."""

    def run(start: DataParallelStart, parallel: ParallelState) -> int:
        if not parallel.is_tp_leader:
            return serve_follower(serving_rank(start.config), parallel)
        config = rank_config(start.config, parallel.dp_rank)
        if own is not None:
            config = msgspec.structs.replace(
                config, host=own.host, advertise_host=own.advertise_host, port=own.port, metrics_port=own.metrics_port
            )
        return asyncio.run(serve_rank(config, parallel, start.config.id, announce=own is not None))

    return run_rank(
        DataParallelStart, run, logger=logger, log_level=logging.INFO, log_format=_WORKER_LOG_FORMAT, joined=joined
    )


if __name__ == "__main__":
    sys.exit(main())
