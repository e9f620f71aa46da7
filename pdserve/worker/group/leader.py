"""A worker of several ranks: its child processes and rank 0's link to their NIXL agents.

Start-up: rank 0 (the worker process) opens its ``GroupLink``, starts ranks 1..N-1
(``pdserve.worker.group.rank_main``, handed the link's address) or, across hosts, waits for
them to come, and joins their group; the engine
it builds next sends them the KV cache's size, after which each rank starts its agent and
says hello. Shutdown: the engine stops the ranks' steps, the link closes (their KV services
end with it), and the processes are waited for, then killed.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import msgspec

from pdserve.distributed.parallel_state import ParallelState
from pdserve.distributed.rank_group import RankGroup, start_group
from pdserve.engine.engine import LLMEngine
from pdserve.kvtransfer import PeerInfo
from pdserve.worker.config import WorkerConfig
from pdserve.worker.group.link import GroupLink
from pdserve.worker.group.rank_main import ServingRank

logger = logging.getLogger(__name__)


@dataclass
class WorkerGroup:
    ranks: RankGroup
    link: GroupLink
    timeout_s: float  # how long the ranks may take to start their agents (the rendezvous deadline)

    @property
    def state(self) -> ParallelState:
        assert self.ranks.state is not None
        return self.ranks.state

    @classmethod
    async def start(cls, config: WorkerConfig, agent_name: str) -> WorkerGroup:
        """Start ranks 1..N-1 of ``config``'s group and join it as rank 0 (blocks while they load)."""
        parallel = config.parallel
        # A rank silent past the collective deadline would fail the next step anyway: the link says so sooner.
        link = GroupLink(parallel.world_size, silence_s=parallel.collective_timeout_s)
        # Across hosts the link listens where the worker does, and the ranks dial its advertised address.
        across = config.placement is not None
        _, port = await link.open(config.host if across else "127.0.0.1")
        host = config.reachable_host if across else "127.0.0.1"
        payload = msgspec.msgpack.encode(
            ServingRank(
                model=config.model,
                engine=config.engine,
                role=config.role,
                model_name=config.served_model_name,
                agent_name=agent_name,
                link_host=host,
                link_port=port,
                transfer_timeout_s=config.transfer_timeout_s,
                num_threads=config.num_threads,
            )
        )
        try:
            # Synchronous on purpose: the rendezvous binds this thread to its device (CUDA).
            ranks = start_group(
                parallel,
                "pdserve.worker.group.rank_main",
                payload,
                config.engine.device,
                config.placement,
                config.reachable_host,
            )
        except BaseException:
            await link.close()
            raise
        assert ranks is not None
        return cls(ranks, link, parallel.rendezvous_timeout_s)

    async def wait_agents(self) -> list[PeerInfo]:
        """Ranks 1..N-1's NIXL metadata, once every rank's agent runs (after the engine is built)."""
        return await self.link.wait_ranks(self.timeout_s)

    async def close(self, engine: LLMEngine | None) -> None:
        """Stop the ranks' steps (``engine``: rank 0's, its step loop stopped), their KV services,
        then their processes."""
        self.link.closing()  # the ranks close their links as their steps stop
        if engine is not None:
            try:
                engine.close()
            except Exception:  # a rank already gone: the processes are stopped below all the same
                logger.warning("the group's ranks could not be told to stop", exc_info=True)
        await self.link.close()
        await asyncio.to_thread(self.ranks.close)
