"""KVMailbox: a pending Decode call gets the first KVReady meant for it, whichever comes first."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.v1 import worker_pb2
from pdserve.worker.kv_mailbox import KVMailbox


def ready(worker_id: str = "p1", first_token_id: int = 7) -> worker_pb2.KVSource:
    return worker_pb2.KVSource(worker_id=worker_id, block_ids=[3, 4], first_token_id=first_token_id)


def test_a_delivery_reaches_the_call_waiting_for_it_and_a_repeat_is_refused():
    async def scenario() -> None:
        mailbox = KVMailbox()
        waiting = asyncio.ensure_future(mailbox.receive("r1", "p1", timeout_s=5))
        await asyncio.sleep(0.01)
        assert not waiting.done() and mailbox.num_waiting == 1  # what a drain waits for
        assert mailbox.deliver("r1", ready(first_token_id=7))
        assert (await waiting).first_token_id == 7 and mailbox.num_waiting == 0
        assert not mailbox.deliver("r1", ready(first_token_id=8))  # the frontend's, after the prefill worker's

    asyncio.run(scenario())


def test_a_delivery_before_its_call_is_kept_for_it():
    async def scenario() -> None:
        mailbox = KVMailbox()
        assert mailbox.deliver("r1", ready(first_token_id=9))
        assert not mailbox.deliver("r1", ready(first_token_id=9))
        assert (await mailbox.receive("r1", "p1", timeout_s=0.01)).first_token_id == 9

    asyncio.run(scenario())


def test_a_delivery_from_another_prefill_worker_does_not_feed_the_call():
    async def scenario() -> None:
        mailbox = KVMailbox()
        assert mailbox.deliver("r1", ready("p2"))
        with pytest.raises(TimeoutError):
            await mailbox.receive("r1", "p1", timeout_s=0.05)

    asyncio.run(scenario())


def test_a_call_that_gave_up_takes_nothing_later_and_nothing_stays():
    async def scenario() -> None:
        mailbox = KVMailbox(keep_s=0.05)
        with pytest.raises(TimeoutError):
            await mailbox.receive("r1", "p1", timeout_s=0.05)
        assert not mailbox.deliver("r1", ready())  # its call ended
        waiting = asyncio.ensure_future(mailbox.receive("r2", "p1", timeout_s=5))
        await asyncio.sleep(0.01)
        waiting.cancel()  # the frontend cancelled the call
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not mailbox.deliver("r2", ready())
        await asyncio.sleep(0.1)
        mailbox.deliver("r3", ready())  # any delivery sweeps what expired
        assert len(mailbox) == 1

    asyncio.run(scenario())


def test_unclaimed_deliveries_expire_and_are_bounded():
    async def scenario() -> None:
        mailbox = KVMailbox(keep_s=0.05, max_slots=3)
        assert mailbox.deliver("old", ready())
        await asyncio.sleep(0.1)
        with pytest.raises(TimeoutError):  # kept no longer than keep_s
            await mailbox.receive("old", "p1", timeout_s=0.01)
        mailbox = KVMailbox(keep_s=60, max_slots=3)
        for n in range(5):
            mailbox.deliver(f"r{n}", ready(first_token_id=n))
        assert len(mailbox) == 3  # the oldest go first past max_slots
        assert (await mailbox.receive("r4", "p1", timeout_s=0.01)).first_token_id == 4
        with pytest.raises(TimeoutError):
            await mailbox.receive("r0", "p1", timeout_s=0.01)

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_second_call_for_the_same_request_is_refused_by_name():
    async def scenario() -> None:
        mailbox = KVMailbox()
        first = asyncio.ensure_future(mailbox.receive("r1", "p1", timeout_s=5))
        await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="'r1'.*'p1'"):
            await mailbox.receive("r1", "p1", timeout_s=5)
        mailbox.deliver("r1", ready())
        assert (await first).worker_id == "p1"

    asyncio.run(scenario())
