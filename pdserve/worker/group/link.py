"""Rank 0's end of a serving group's KV links: one TCP connection from each other rank.

Rank 0 listens before it starts the group (the address goes into the ranks' start payload);
each rank connects once its NIXL agent runs and says hello with its agent's metadata, which
rank 0 publishes with its own (``wait_ranks``, bounded by a deadline). From then on rank 0
orders the decode ranks' pulls (``pull``: every rank's answer, or a failure, by a deadline),
tells them which peers left, tells the prefill ranks which pins to expect notices for, and
hears from the prefill ranks when a request's notices are all in (``on_sent``).

A rank whose connection ends has died (or its group is shutting down): its pending answers
fail at once and ``on_lost`` tells the worker, which cannot serve without it. So does a rank
that says nothing for ``silence_s`` (each rank says it is alive every second): a stopped or hung
process keeps its connection open, and would otherwise be found only by the next step's
collective or pull, or never while the worker is idle.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

from pdserve.distributed.parallel_config import COLLECTIVE_TIMEOUT_S
from pdserve.kvtransfer import PeerInfo
from pdserve.worker.group.messages import (
    ExpectNotices,
    ForgetPeers,
    Message,
    PullDone,
    PullOrder,
    RankAlive,
    RankHello,
    RankSent,
    read_message,
    write_message,
)

logger = logging.getLogger(__name__)


class RankLost(RuntimeError):
    """A rank of the group closed its link (it died), or never connected in time."""


class GroupLink:
    """``size``: the group's ranks, rank 0 included. ``on_sent(rank, request_id)`` and
    ``on_lost(reason)`` run on the event loop. ``silence_s``: how long a rank may say nothing."""

    def __init__(
        self,
        size: int,
        *,
        silence_s: float = COLLECTIVE_TIMEOUT_S,
        on_sent: Callable[[int, str], None] = lambda rank, request_id: None,
        on_lost: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.size = size
        self.on_sent = on_sent
        self.on_lost = on_lost
        self.silence_s = silence_s
        self._heard: dict[int, float] = {}  # rank -> when it last said anything (monotonic)
        self._watchdog: asyncio.Task[None] | None = None
        self._server: asyncio.Server | None = None
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._peers: dict[int, PeerInfo] = {}
        self._joined = asyncio.Event()
        self._readers: set[asyncio.Task[None]] = set()
        self._pending: dict[tuple[int, int], asyncio.Future[PullDone]] = {}
        self._order_ids = itertools.count(1)
        self._closed = False

    async def open(self, host: str = "127.0.0.1") -> tuple[str, int]:
        """Listen on an ephemeral port; returns the address the ranks connect to."""
        self._server = await asyncio.start_server(self._on_connection, host, 0)
        self._watchdog = asyncio.ensure_future(self._watch_silence())
        return host, self._server.sockets[0].getsockname()[1]

    async def _watch_silence(self) -> None:
        while not self._closed:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for rank, heard in list(self._heard.items()):
                if now - heard > self.silence_s and rank in self._writers:
                    logger.error(
                        "rank %d of the group said nothing for %.0f s: it is stopped or hung", rank, now - heard
                    )
                    self._lose(rank)

    async def wait_ranks(self, timeout_s: float) -> list[PeerInfo]:
        """Ranks 1..size-1's agent metadata, in rank order, once all have said hello."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._joined.wait()
        except TimeoutError:
            missing = sorted(set(range(1, self.size)) - set(self._peers))
            raise RankLost(f"ranks {missing} did not start their NIXL agents within {timeout_s:.0f} s") from None
        return [self._peers[rank] for rank in range(1, self.size)]

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await read_message(reader)
        if not isinstance(hello, RankHello) or not 0 < hello.rank < self.size or hello.rank in self._writers:
            logger.error("a group link connection did not say a valid hello: %r", hello)
            writer.close()
            return
        rank = hello.rank
        self._writers[rank] = writer
        self._heard[rank] = time.monotonic()
        self._peers[rank] = hello.peer
        if len(self._peers) == self.size - 1:
            self._joined.set()
        task = asyncio.current_task()
        assert task is not None
        self._readers.add(task)
        try:
            while (message := await read_message(reader)) is not None:
                self._heard[rank] = time.monotonic()
                self._dispatch(rank, message)
        finally:
            self._readers.discard(task)
            self._lose(rank)

    def _dispatch(self, rank: int, message: Message) -> None:
        if isinstance(message, PullDone):
            future = self._pending.pop((rank, message.order_id), None)
            if future is not None and not future.done():
                future.set_result(message)
        elif isinstance(message, RankSent):
            self.on_sent(rank, message.request_id)
        elif isinstance(message, RankAlive):
            pass  # its arrival is the news
        else:
            logger.error("rank %d sent rank 0 an unexpected %s", rank, type(message).__name__)

    def _lose(self, rank: int) -> None:
        """Rank ``rank`` is gone: once, whether its link ended or it fell silent first."""
        writer = self._writers.pop(rank, None)
        self._heard.pop(rank, None)
        if writer is None:
            return
        writer.close()
        for key, future in list(self._pending.items()):
            if key[0] == rank:
                del self._pending[key]
                if not future.done():
                    future.set_exception(RankLost(f"rank {rank} is gone"))
        if not self._closed:
            logger.error("rank %d of the group is gone", rank)
            self.on_lost(f"rank {rank} of the group is gone")

    # ---- orders ----------------------------------------------------------------------------
    def order_pull(
        self,
        request_id: str,
        peers: list[PeerInfo],
        remote_block_ids: list[int],
        local_block_ids: list[int],
        num_cached_blocks: int,
        deadline_s: float,
    ) -> list[asyncio.Future[PullDone]]:
        """Order every other rank's pull of ``request_id``; one future per rank, in rank order,
        that ends with its ``PullDone`` (or ``RankLost``). The caller bounds the wait."""
        order = PullOrder(
            order_id=next(self._order_ids),
            request_id=request_id,
            peers=peers,
            remote_block_ids=remote_block_ids,
            local_block_ids=local_block_ids,
            num_cached_blocks=num_cached_blocks,
            deadline_s=deadline_s,
        )
        loop = asyncio.get_running_loop()
        futures = []
        for rank in range(1, self.size):
            future: asyncio.Future[PullDone] = loop.create_future()
            writer = self._writers.get(rank)
            if writer is None:
                future.set_exception(RankLost(f"rank {rank} is gone"))
            else:
                self._pending[(rank, order.order_id)] = future
                write_message(writer, order)
            futures.append(future)
        return futures

    def forget_peers(self, names: list[str]) -> None:
        """Tell every other rank to drop these NIXL peers (they left the registry)."""
        self._broadcast(ForgetPeers(names=names))

    def expect_notices(self, request_id: str, within_s: float) -> None:
        """Tell every other rank that ``request_id``'s pin waits for completion notices."""
        self._broadcast(ExpectNotices(request_id=request_id, within_s=within_s))

    def _broadcast(self, message: Message) -> None:
        for writer in self._writers.values():
            write_message(writer, message)

    def closing(self) -> None:
        """The group is being shut down: a rank's link ending from now on is no loss."""
        self._closed = True

    async def close(self) -> None:
        """Close every link and stop listening (the ranks' services end when their link does)."""
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers.values()):
            writer.close()  # the readers see the end of their streams and return
        readers = list(self._readers)
        if readers:
            # Not cancelled first: asyncio's stream server logs a cancelled handler as an error.
            _, stuck = await asyncio.wait(readers, timeout=5.0)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
        if self._server is not None:
            try:
                async with asyncio.timeout(5.0):
                    await self._server.wait_closed()
            except TimeoutError:
                logger.warning("the group link's server did not close within 5 s")
