"""Rank 0's link finds a rank that is stopped or hung by its silence, not only one whose
connection ends: a real RankService keeps saying it is alive; a rank that falls silent (its
process stopped, its connection still open) is lost once ``silence_s`` passes."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.discovery.registry import Role
from pdserve.worker.group.link import GroupLink, RankLost
from pdserve.worker.group.messages import RankHello, write_message
from pdserve.worker.group.rank_service import RankService
from tests.utils.aio import run_scenario
from tests.worker.group.test_pull import rank_agent

SILENCE_S = 2.0


def test_a_live_rank_is_never_taken_for_a_silent_one():
    async def body() -> None:
        lost: list[str] = []
        link = GroupLink(2, silence_s=SILENCE_S, on_lost=lost.append)
        address = await link.open()
        service = RankService(
            1, Role.DECODE, rank_agent("d.rank1", 2, 1), address, transfer_timeout_s=5.0, connect_timeout_s=10.0
        )
        running = asyncio.ensure_future(service.run())
        try:
            await link.wait_ranks(30.0)
            await asyncio.sleep(3 * SILENCE_S)  # idle: no order, no notice; only its heartbeat
            assert lost == []
        finally:
            link.closing()
            await link.close()
            await running

    run_scenario(body())


def test_a_rank_that_falls_silent_is_lost_and_its_pending_pull_fails():
    async def body() -> None:
        lost: list[str] = []
        link = GroupLink(2, silence_s=SILENCE_S, on_lost=lost.append)
        address = await link.open()
        agent = rank_agent("d.rank1", 2, 1)
        await agent.start()
        # A rank that said hello and then stopped: its socket stays open, nothing more comes.
        reader, writer = await asyncio.open_connection(*address)
        write_message(writer, RankHello(rank=1, peer=agent.info))
        try:
            await link.wait_ranks(10.0)
            [pending] = link.order_pull("r1", [], [0], [0], 0, deadline_s=60.0)
            started = time.monotonic()
            with pytest.raises(RankLost, match="rank 1 is gone"):
                await asyncio.wait_for(pending, 30.0)
            assert SILENCE_S <= time.monotonic() - started < SILENCE_S + 3
            assert lost == ["rank 1 of the group is gone"]
        finally:
            writer.close()
            link.closing()
            await link.close()
            await agent.close()

    run_scenario(body())
