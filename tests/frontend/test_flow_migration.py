"""A decode worker's stream that breaks mid-request migrates the request: the client sees one
stream, no token twice and none lost, and the breakdown says where it went; bounded by
``max_migrations`` and the deadline.

Scripted workers (``fake_worker.FakeWorker``) with a ``counting`` script: the request's n-th
output token is ``COUNTING_BASE + n``, so a continuation that skipped, repeated or restarted
tokens shows in the stream. ``fail_after`` breaks a worker's stream as a dying worker's does.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.v1 import inference_pb2
from tests.frontend.fake_worker import COUNTING_BASE, FakeWorker, Script, serving
from tests.frontend.test_flow import (
    BUSY_DECODE,
    DEADLINE_S,
    SCENARIO_TIMEOUT_S,
    final_of,
    flow_error,
    new_flow,
    run_flow,
    token_ids,
)
from tests.utils.aio import eventually, run_scenario

MAX_TOKENS = 8  # new_flow's
EXPECTED = [COUNTING_BASE + n for n in range(MAX_TOKENS)]
BUSY_DECODE_2 = BUSY_DECODE.__class__(running=8)  # tried after d1 and d2


def _decode_ids(routing) -> set[str]:
    return {w.worker_id for w in routing.view.workers()}


def _decode(worker_id: str, fail_after: int | None = None, busy: int = 0) -> FakeWorker:
    load = [BUSY_DECODE.__class__(), BUSY_DECODE, BUSY_DECODE_2][busy]
    return FakeWorker(worker_id, "decode", Script(counting=True, fail_after=fail_after), load=load)


@pytest.mark.parametrize("disaggregation", ["always", "off"], ids=["kv-from-prefill-worker", "prompt-on-decode-worker"])
def test_a_stream_that_breaks_mid_request_goes_on_on_another_decode_worker(
    etcd_url: str, model: str, disaggregation: str
) -> None:
    prefill = FakeWorker("p1", "prefill", Script(counting=True))
    failing, taker = _decode("d1", fail_after=3), _decode("d2", busy=1)

    async def body() -> tuple[str, list[inference_pb2.GenerateResponse]]:
        async with serving(etcd_url, model, [prefill, failing, taker], disaggregation) as routing:
            flow = await new_flow(routing, model)
            return flow.request_id, await run_flow(flow)

    request_id, responses = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert token_ids(responses) == EXPECTED  # one stream: none twice, none lost
    final = final_of(responses)
    assert (final.finish_reason, final.usage.completion_tokens) == ("length", MAX_TOKENS)
    b = final.breakdown
    streamed = 4 if disaggregation == "always" else 3  # the prefill worker's first token, then d1's three
    assert b.decode_worker == "d2" and b.migrations == 1
    assert [(m.from_worker, m.to_worker, m.tokens_streamed) for m in b.migration_history] == [("d1", "d2", streamed)]
    assert "UNAVAILABLE d1 died" in b.migration_history[0].reason
    continued = taker.decodes[0]
    assert continued.request_id == f"{request_id}.m1"  # never the broken attempt's id
    assert list(continued.prompt_token_ids) == list(failing.decodes[0].prompt_token_ids)
    if disaggregation == "always":  # the KV is rebuilt on a prefill worker, which samples the next token
        assert b.prefill_worker == "p1" and b.migration_history[0].prefill_worker == "p1"
        assert [list(p.generated_token_ids) for p in prefill.prefills] == [[], EXPECTED[:streamed]]
        assert list(continued.generated_token_ids) == EXPECTED[:streamed]  # and the prefill worker's token in kv_source
        assert continued.kv_source.first_token_id == EXPECTED[streamed]
    else:  # the KV is rebuilt on the new decode worker itself
        assert b.migration_history[0].prefill_worker == "d2"
        assert list(continued.generated_token_ids) == EXPECTED[:streamed] and not continued.HasField("kv_source")


def test_a_stream_on_a_rank_that_breaks_migrates_to_another_group_never_to_a_sibling(etcd_url: str, model: str) -> None:
    """d1 and d1-dp1 are one data-parallel group: d1's stream breaks, and the request goes to d2,
    busier than the idle sibling, which is failing with d1."""
    failing = FakeWorker("d1", "decode", Script(counting=True, fail_after=3), group=("d1", 2, 0))
    sibling = FakeWorker("d1-dp1", "decode", Script(counting=True), load=BUSY_DECODE, group=("d1", 2, 1))
    other = _decode("d2", busy=2)

    async def body() -> list[inference_pb2.GenerateResponse]:
        async with serving(etcd_url, model, [failing, sibling, other], "off") as routing:
            return await run_flow(await new_flow(routing, model))

    responses = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert token_ids(responses) == EXPECTED
    b = final_of(responses).breakdown
    assert [(m.from_worker, m.to_worker) for m in b.migration_history] == [("d1", "d2")]
    assert sibling.decodes == [] and b.decode_worker == "d2"


def test_migration_gives_up_after_max_migrations_naming_every_worker_tried(etcd_url: str, model: str) -> None:
    workers = [_decode("d1", fail_after=1), _decode("d2", fail_after=1, busy=1), _decode("d3", fail_after=1, busy=2)]
    received: list[inference_pb2.GenerateResponse] = []

    async def body() -> None:
        async with serving(etcd_url, model, workers, "off", max_migrations=2) as routing:
            flow = await new_flow(routing, model)
            with pytest.raises(Exception) as caught:
                async for response in flow.run():
                    received.append(response)
            raise caught.value

    with pytest.raises(Exception) as caught:
        run_scenario(body(), SCENARIO_TIMEOUT_S)
    error = caught.value
    assert getattr(error, "code", None) == grpc.StatusCode.UNAVAILABLE
    assert "d1, d2, d3" in error.message and "max_migrations" in error.message
    assert token_ids(received) == EXPECTED[:3]  # each worker streamed one token, each the next
    assert [len(w.decodes) for w in workers] == [1, 1, 1]


def test_no_migration_when_max_migrations_is_zero(etcd_url: str, model: str) -> None:
    failing, other = _decode("d1", fail_after=2), _decode("d2", busy=1)

    async def body():
        async with serving(etcd_url, model, [failing, other], "off", max_migrations=0) as routing:
            return await flow_error(await new_flow(routing, model))

    error = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert error.code == grpc.StatusCode.UNAVAILABLE and "d1" in error.message
    assert other.decodes == []


def test_no_other_decode_worker_waits_for_one_until_the_deadline_naming_the_failed_one(
    etcd_url: str, model: str
) -> None:
    """The only other decode worker may be restarting: the request waits for one until its
    deadline, then fails with DEADLINE_EXCEEDED naming the worker that failed it."""
    deadline_s = 2.0

    async def body():
        async with serving(etcd_url, model, [_decode("d1", fail_after=2)], "off") as routing:
            started = time.monotonic()
            error = await flow_error(await new_flow(routing, model, deadline_s))
            return error, time.monotonic() - started

    error, waited = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert waited >= deadline_s - 0.5
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "waiting for a decode worker" in error.message and "decode failed on d1" in error.message


def test_no_decode_worker_back_within_the_migration_wait_is_unavailable_before_the_deadline(
    etcd_url: str, model: str
) -> None:
    """A worker given up on never comes back: the wait is bounded by migration_wait_s too."""

    async def body():
        async with serving(etcd_url, model, [_decode("d1", fail_after=2)], "off", migration_wait_s=1.0) as routing:
            started = time.monotonic()
            error = await flow_error(await new_flow(routing, model, deadline_s=20.0))
            return error, time.monotonic() - started

    error, waited = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert 0.8 <= waited < 5.0
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "no decode worker is available" in error.message and "decode failed on d1" in error.message


def test_a_stream_broken_after_its_last_token_ends_without_a_migration(etcd_url: str, model: str) -> None:
    """Only the final message was lost: max_tokens were streamed, so the request is over."""
    failing, other = _decode("d1", fail_after=MAX_TOKENS), _decode("d2", busy=1)

    async def body():
        async with serving(etcd_url, model, [failing, other], "off") as routing:
            return await run_flow(await new_flow(routing, model))

    responses = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert token_ids(responses) == EXPECTED and final_of(responses).finish_reason == "length"
    assert other.decodes == []


def test_a_pull_that_failed_on_a_dead_prefill_worker_prefills_again_elsewhere_and_keeps_the_decode_worker(
    etcd_url: str, model: str
) -> None:
    """The decode worker refused with KV_SOURCE_FAILED: it is not at fault, so the request goes
    back to it, prefilled on the other prefill worker; the lost one is not tried again."""
    prefills = [FakeWorker("p1", "prefill", Script(counting=True)), FakeWorker("p2", "prefill", Script(counting=True))]
    decode = FakeWorker("d1", "decode", Script(counting=True, failed_pulls=1))

    async def body() -> list[inference_pb2.GenerateResponse]:
        async with serving(etcd_url, model, [*prefills, decode], "always") as routing:
            return await run_flow(await new_flow(routing, model))

    responses = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert token_ids(responses) == EXPECTED  # the first attempt's token once, then the rest
    lost = decode.decodes[0].kv_source.worker_id
    kept = decode.decodes[1].kv_source.worker_id
    assert kept != lost and len(decode.decodes) == 2
    assert [len(p.prefills) for p in prefills if p.worker_id == lost] == [1]  # never tried again
    b = final_of(responses).breakdown
    assert (b.decode_worker, b.migrations) == ("d1", 1)
    [move] = b.migration_history
    assert (move.from_worker, move.to_worker, move.prefill_worker, move.tokens_streamed) == ("d1", "d1", kept, 1)
    assert f"KV pull from {lost} failed" in move.reason


def test_a_pull_that_failed_with_no_other_prefill_worker_fails_at_once_naming_it(etcd_url: str, model: str) -> None:
    """No waiting for the deadline: the decode worker is there, the prefill role has no one left."""
    prefill, decode = (
        FakeWorker("p1", "prefill", Script(counting=True)),
        FakeWorker("d1", "decode", Script(failed_pulls=1)),
    )

    async def body():
        async with serving(etcd_url, model, [prefill, decode], "always") as routing:
            started = time.monotonic()
            error = await flow_error(await new_flow(routing, model, deadline_s=20.0))
            return error, time.monotonic() - started

    error, took = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert took < 5.0
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "no prefill worker is available" in error.message and "KV could not be pulled from p1" in error.message


# ---- a worker's channel closed under a call (the frontend closes it when the worker leaves) ------


def test_a_stream_whose_channel_is_closed_mid_request_migrates_instead_of_hanging(etcd_url: str, model: str) -> None:
    """Closing a channel cancels its calls, and gRPC raises that in the caller as a
    CancelledError, though nobody cancelled the flow. Let through, it would end the client's
    stream with no status: the client would wait for its deadline."""
    slow = FakeWorker("d1", "decode", Script(counting=True, token_gap_s=0.5))
    taker = _decode("d2", busy=1)

    async def body() -> list[inference_pb2.GenerateResponse]:
        async with serving(etcd_url, model, [slow, taker], "off") as routing:
            received = []
            async with asyncio.timeout(DEADLINE_S):
                async for response in (await new_flow(routing, model)).run():
                    received.append(response)
                    if len(received) == 2:
                        await slow.leave()
                        await eventually(lambda: "d1" not in _decode_ids(routing), 5.0, "d1 gone from the view")
                        routing.channels.close(slow.endpoint)  # what the gateway does as d1 leaves
            return received

    responses = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert token_ids(responses) == EXPECTED
    [move] = final_of(responses).breakdown.migration_history
    assert (move.from_worker, move.to_worker) == ("d1", "d2")
    assert f"UNAVAILABLE the channel to {slow.endpoint} was closed" in move.reason


def test_a_stream_cut_as_its_only_worker_left_the_registry_goes_on_there_once_it_is_back(
    etcd_url: str, model: str
) -> None:
    """A registry that lost its data (etcd restarted empty) drops every worker at once and they
    register again under the same ids: a stream cut that way is no failure of its worker, which
    takes the request again rather than being excluded as a failed one would be."""
    only = FakeWorker("d1", "decode", Script(counting=True, token_gap_s=0.3))

    async def body() -> list[inference_pb2.GenerateResponse]:
        async with serving(etcd_url, model, [only], "off", migration_wait_s=3.0) as routing:
            received = []
            async with asyncio.timeout(DEADLINE_S):
                async for response in (await new_flow(routing, model)).run():
                    received.append(response)
                    if len(received) == 2:
                        await only.leave()
                        await eventually(lambda: "d1" not in _decode_ids(routing), 5.0, "d1 gone from the view")
                        routing.channels.close(only.endpoint)  # what the gateway does as d1 leaves
                        await only.register()  # the same id, back in the registry
            return received

    responses = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert token_ids(responses) == EXPECTED
    [move] = final_of(responses).breakdown.migration_history
    assert (move.from_worker, move.to_worker) == ("d1", "d1")
    assert "the worker left the registry" in move.reason


@pytest.mark.slow
def test_a_decode_call_opened_beside_the_prefill_on_a_worker_that_leaves_moves_on(etcd_url: str, model: str) -> None:
    prefill = FakeWorker("p1", "prefill", Script(counting=True, prefill_s=2.0, silent_prefill=True))
    leaving, taker = _decode("d1"), _decode("d2", busy=1)

    async def body() -> list[inference_pb2.GenerateResponse]:
        async with serving(etcd_url, model, [prefill, leaving, taker], "always") as routing:
            running = asyncio.ensure_future(run_flow(await new_flow(routing, model)))
            await eventually(lambda: len(leaving.pending_decodes) == 1, 5.0, "the decode call opened on d1")
            await leaving.leave()
            await eventually(lambda: "d1" not in _decode_ids(routing), 5.0, "d1 gone from the view")
            routing.channels.close(leaving.endpoint)  # while the prompt still computes
            return await running

    responses = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert token_ids(responses) == EXPECTED
    assert leaving.decodes == []  # its call never got the KV
    [move] = final_of(responses).breakdown.migration_history
    assert (move.from_worker, move.to_worker, move.tokens_streamed) == ("d1", "d2", 1)
