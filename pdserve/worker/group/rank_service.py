"""The KV side of a serving group's rank 1..N-1: its NIXL agent, driven by rank 0's link.

The rank's KV cache holds its share of the heads of every block rank 0's engine allocates, at
the same block ids. Its agent registers that cache under the rank's own ``KVLayout``, and:

- decode: pulls what rank 0 orders (``PullOrder``) into it — exactly this rank's heads, from
  the prefill ranks holding them — notifies those prefill ranks, and answers ``PullDone``;
- prefill: tallies the decode ranks' completion notices for its heads (``SentReporter``) and
  tells rank 0 when a request's are all in (``RankSent``); rank 0 frees the pin once every
  rank has. It fetches notices only while a pin it was told of (``ExpectNotices``) may get one.

It runs on its own thread and event loop, beside the step-following main thread; it ends when
rank 0 closes the link, or when ``stop`` is called.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.discovery.registry import Role
from pdserve.kvtransfer import KVAgent, KVPuller, LayoutMismatch, SentReporter, TransferFailed
from pdserve.worker.group.messages import (
    ALIVE_INTERVAL_S,
    ExpectNotices,
    ForgetPeers,
    PullDone,
    PullOrder,
    RankAlive,
    RankHello,
    RankSent,
    read_message,
    write_message,
)

logger = logging.getLogger(__name__)


class RankService:
    """``rank``'s agent and its link to rank 0 at ``address``; ``run`` on the rank's KV thread."""

    def __init__(
        self,
        rank: int,
        role: Role,
        agent: KVAgent,
        address: tuple[str, int],
        *,
        transfer_timeout_s: float,
        connect_timeout_s: float,
    ) -> None:
        self.rank = rank
        self.role = role
        self.agent = agent
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.puller = KVPuller(agent, deadline_s=transfer_timeout_s)
        self.sent = SentReporter(agent, self._on_sent, is_wanted=self._wants_notices)
        self._expected: dict[str, float] = {}  # request id -> when its pin runs out (monotonic)
        self._writer: asyncio.StreamWriter | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self) -> None:
        """Start the agent, say hello to rank 0, serve its orders until the link ends."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        await self.agent.start()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, self._writer = await asyncio.open_connection(*self.address)
            write_message(self._writer, RankHello(rank=self.rank, peer=self.agent.info))
            if self.role is Role.PREFILL:
                self.sent.start()
            reading = asyncio.ensure_future(self._serve(reader))
            stopping = asyncio.ensure_future(self._stop.wait())
            beating = asyncio.ensure_future(self._beat(self._writer))
            await asyncio.wait([reading, stopping], return_when=asyncio.FIRST_COMPLETED)
            for future in (reading, stopping, beating):
                future.cancel()
            await asyncio.gather(reading, stopping, beating, *self._tasks, return_exceptions=True)
            await self.puller.close()
        finally:
            self.sent.close()
            if self._writer is not None:
                self._writer.close()
            await self.agent.close()

    @staticmethod
    async def _beat(writer: asyncio.StreamWriter) -> None:
        while not writer.is_closing():
            write_message(writer, RankAlive())
            await asyncio.sleep(ALIVE_INTERVAL_S)

    def stop(self) -> None:
        """From any thread: end ``run``."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def _serve(self, reader: asyncio.StreamReader) -> None:
        while (message := await read_message(reader)) is not None:
            if isinstance(message, PullOrder):
                task = asyncio.ensure_future(self._pull(message))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif isinstance(message, ForgetPeers):
                for name in message.names:
                    await self.agent.remove_peer(name, "left the registry")
            elif isinstance(message, ExpectNotices):
                self._expected[message.request_id] = time.monotonic() + message.within_s
                self.sent.wake()
            else:
                logger.error("rank %d got an unexpected %s from rank 0", self.rank, type(message).__name__)

    async def _pull(self, order: PullOrder) -> None:
        try:
            for peer in order.peers:
                await self.agent.add_peer(peer)
            stats = await self.puller.pull(
                order.request_id,
                [peer.agent_name for peer in order.peers],
                order.remote_block_ids,
                order.local_block_ids,
                num_cached_blocks=order.num_cached_blocks,
                deadline_s=order.deadline_s,
            )
            done = PullDone(
                order_id=order.order_id,
                ok=True,
                num_bytes=stats.num_bytes,
                num_descriptors=stats.num_descriptors,
                num_transfers=stats.num_transfers,
            )
        except TransferFailed as exc:
            done = PullDone(order_id=order.order_id, ok=False, reason=exc.reason)
        except (LayoutMismatch, ValueError) as exc:
            done = PullDone(order_id=order.order_id, ok=False, reason=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a broken agent must still answer, or rank 0 waits out its deadline
            logger.exception("rank %d: the pull of %s failed", self.rank, order.request_id)
            done = PullDone(order_id=order.order_id, ok=False, reason=f"{type(exc).__name__}: {exc}")
        if self._writer is not None:
            write_message(self._writer, done)

    def _wants_notices(self) -> bool:
        now = time.monotonic()
        for request_id in [r for r, until in self._expected.items() if until <= now]:
            del self._expected[request_id]
        return bool(self._expected)

    def _on_sent(self, request_id: str) -> None:
        self._expected.pop(request_id, None)
        if self._writer is not None:
            write_message(self._writer, RankSent(request_id=request_id))
