"""A worker's tensor-parallel ranks, seen from their leader: its link to their NIXL agents and,
on rank 0, their processes.

Start-up: the leader opens its ``GroupLink``; rank 0 then starts ranks 1..N-1
(``pdserve.worker.group.rank_main``) or, across hosts, waits for them to come, and joins their
group (``start``). A data-parallel rank's leader joined a group rank 0 started, and only opens
its link (``lead``). Either way the leader then sends the link's address on its plan channel;
the engine it builds next sends the KV cache's size, after which each rank starts its agent and
says hello. Shutdown: the engine stops the ranks' steps, the link closes (their KV services end
with it), and rank 0 waits for the processes, then kills them.
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
from pdserve.worker.group.rank_main import LinkAddress, ServingRank

logger = logging.getLogger(__name__)


@dataclass
class WorkerGroup:
    state: ParallelState  # the leader's
    link: GroupLink
    timeout_s: float  # how long the ranks may take to start their agents (the rendezvous deadline)
    ranks: RankGroup | None = None  # the processes, where this leader owns them (rank 0)

    @classmethod
    async def start(cls, config: WorkerConfig, agent_name: str) -> WorkerGroup:
        """Start ranks 1..N-1 of ``config``'s group and join it as rank 0 (blocks while they load)."""
        link, address = await _open_link(config)
        payload = msgspec.msgpack.encode(serving_rank(config))
        try:
            # Synchronous on purpose: the rendezvous binds this thread to its device (CUDA).
            ranks = start_group(
                config.parallel,
                "pdserve.worker.group.rank_main",
                payload,
                config.engine.device,
                config.placement,
                config.reachable_host,
            )
        except BaseException:
            await link.close()
            raise
        assert ranks is not None and ranks.state is not None
        group = cls(ranks.state, link, config.parallel.rendezvous_timeout_s, ranks)
        await group.announce(address, agent_name)
        return group

    @classmethod
    async def lead(cls, config: WorkerConfig, parallel: ParallelState, agent_name: str) -> WorkerGroup:
        """Lead the tensor-parallel ranks of this data-parallel rank (its group already formed)."""
        link, address = await _open_link(config)
        group = cls(parallel, link, config.parallel.rendezvous_timeout_s)
        await group.announce(address, agent_name)
        return group

    async def announce(self, address: tuple[str, int], agent_name: str) -> None:
        """Tell the ranks where the link listens (closing the group if that fails)."""
        try:
            self.state.plans.send(LinkAddress(host=address[0], port=address[1], agent_name=agent_name))
        except BaseException:
            await self.close(None)
            raise

    async def wait_agents(self) -> list[PeerInfo]:
        """The other ranks' NIXL metadata, once every rank's agent runs (after the engine is built)."""
        return await self.link.wait_ranks(self.timeout_s)

    async def close(self, engine: LLMEngine | None) -> None:
        """Stop the ranks' steps (``engine``: the leader's, its step loop stopped), their KV
        services, then (rank 0) their processes."""
        self.link.closing()  # the ranks close their links as their steps stop
        if engine is not None:
            try:
                engine.close()
            except Exception:  # a rank already gone: the processes are stopped below all the same
                logger.warning("the group's ranks could not be told to stop", exc_info=True)
        await self.link.close()
        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.close)


def serving_rank(config: WorkerConfig) -> ServingRank:
    """What the tensor-parallel ranks of ``config``'s worker run."""
    return ServingRank(
        model=config.model,
        engine=config.engine,
        role=config.role,
        model_name=config.served_model_name,
        transfer_timeout_s=config.transfer_timeout_s,
        loopback_only=config.loopback_only,
        num_threads=config.num_threads,
    )


async def _open_link(config: WorkerConfig) -> tuple[GroupLink, tuple[str, int]]:
    """The leader's link, listening; and the address its ranks dial."""
    parallel = config.parallel
    # A rank silent past the collective deadline would fail the next step anyway: the link says so sooner.
    link = GroupLink(parallel.tensor_parallel_size, silence_s=parallel.collective_timeout_s)
    # Across hosts the link listens where the worker does, and the ranks dial its advertised address.
    across = config.placement is not None
    _, port = await link.open(config.host if across else "127.0.0.1")
    return link, (config.reachable_host if across else "127.0.0.1", port)
