"""A decode group's pull: every rank reads its own KV heads, rank 0 waits for them all.

Rank 0 orders the other ranks' pulls over the ``GroupLink`` and runs its own at the same
time; each rank reads exactly its heads (``kvtransfer.tp.sources``) from the prefill ranks
that hold them and notifies those ranks itself. The pull has succeeded when every rank's has;
one rank's failure fails the request's transfer (``TransferFailed``), after every rank's pull
has ended — so that the caller may free the blocks, as ``KVPuller.pull`` promises — or after
the deadline and a grace, when a rank that does not answer is taken for lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from pdserve.kvtransfer import KVPuller, PeerInfo, TransferFailed, TransferStats
from pdserve.worker.group.link import GroupLink
from pdserve.worker.group.messages import PullDone

# Beyond a pull's own deadline and cancel grace: a rank's answer crossing the link.
_ANSWER_GRACE_S = 5.0


class GroupPuller:
    """Rank 0's puller for a decode group of ``link.size`` ranks (``link`` None: one rank)."""

    def __init__(self, puller: KVPuller, link: GroupLink | None = None) -> None:
        self.puller = puller
        self.link = link

    @property
    def deadline_s(self) -> float:
        return self.puller.deadline_s

    async def close(self) -> None:
        """Wait for this rank's pulls' background releases and notices."""
        await self.puller.close()

    async def pull(
        self,
        request_id: str,
        peers: Sequence[PeerInfo],
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        *,
        num_cached_blocks: int = 0,
        deadline_s: float,
    ) -> TransferStats:
        """Pull on every rank of the group; the stats add up the ranks' bytes and descriptors.

        ``peers``: the prefill group's ranks, in TP-rank order, already added to rank 0's agent.
        """
        names = [peer.agent_name for peer in peers]
        own_pull = self.puller.pull(
            request_id,
            names,
            remote_block_ids,
            local_block_ids,
            num_cached_blocks=num_cached_blocks,
            deadline_s=deadline_s,
        )
        if self.link is None:
            return await own_pull
        start = time.perf_counter()
        others = self.link.order_pull(
            request_id, list(peers), list(remote_block_ids), list(local_block_ids), num_cached_blocks, deadline_s
        )
        own: asyncio.Future[Any] = asyncio.ensure_future(own_pull)
        wait_s = deadline_s + self.puller.cancel_grace_s + _ANSWER_GRACE_S
        try:
            done, pending = await asyncio.wait([own, *others], timeout=wait_s)
        except asyncio.CancelledError:
            # The request was aborted: rank 0's pull cancels its transfers and notifies; the others
            # end by their deadline. Their blocks are freed after this returns, so wait for them.
            own.cancel()
            await asyncio.wait([own, *others], timeout=wait_s)
            raise
        failures = []
        for future in pending:
            future.cancel()
        for rank, future in enumerate([own, *others]):
            if future in pending:
                failures.append(f"rank {rank}: no answer within {wait_s:.0f} s")
            elif future.exception() is not None:
                error = future.exception()
                reason = error.reason if isinstance(error, TransferFailed) else str(error)
                failures.append(f"rank {rank}: {reason}")
            elif isinstance(future.result(), PullDone) and not future.result().ok:
                failures.append(f"rank {rank}: {future.result().reason}")
        if failures:
            raise TransferFailed(request_id, "; ".join(failures))
        stats: TransferStats = own.result()
        for future in others:
            answer: PullDone = future.result()
            stats.num_bytes += answer.num_bytes
            stats.num_descriptors += answer.num_descriptors
            stats.num_transfers += answer.num_transfers
        stats.seconds = time.perf_counter() - start
        return stats
