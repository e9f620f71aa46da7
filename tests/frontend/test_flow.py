"""RequestFlow's seams: prefill retry and fallback, decode hand-over, Release, the deadline
(migration after a broken decode stream: test_flow_migration.py).

Real parts but no model: scripted workers (``fake_worker.FakeWorker``) on real grpc.aio servers
on 127.0.0.1, reached through the real ``WorkerChannels`` and chosen by the real ``Router``.

The registry is real too: each fake worker registers its ``WorkerEntry`` with a real
``WorkerRegistration`` in the session's etcd (``etcd_url`` in tests/conftest.py), and the flow
reads a real ``RegistryView`` of it. That costs one etcd per session, which other tests start
anyway, and about a second per test, and it routes exactly as the frontend does; a stand-in
view would have been one more fake to keep in step with the real one for nothing. Each test
has a model name of its own, so tests never see each other's workers.

What the tests check is what the workers receive (which calls, which Release) and what the
client sees (tokens, one final message, or a gRPC code), not the flow's internal flags.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence

import grpc
import pytest

from pdserve.frontend.catalog import ModelCatalog
from pdserve.frontend.flow import FlowError, RequestFlow, Routing
from pdserve.lifecycle import cancel_and_wait
from pdserve.types.engine_load import EngineLoad
from pdserve.v1 import inference_pb2
from tests.frontend.fake_worker import FIRST_TOKEN_ID, FakeWorker, Script, serving
from tests.utils.aio import eventually, run_scenario

PROMPT = list(range(1, 41))  # long enough that conditional disaggregation sends it to a prefill worker
DEADLINE_S = 10.0  # each request's deadline unless a test sets a shorter one
SCENARIO_TIMEOUT_S = 60.0
# Reported load that makes the router try a worker after the idle ones.
BUSY_PREFILL = EngineLoad(queued_prefill_tokens=1000)
BUSY_DECODE = EngineLoad(running=4)


async def new_flow(routing: Routing, model: str, deadline_s: float = DEADLINE_S) -> RequestFlow:
    request = inference_pb2.GenerateRequest(
        model=model,
        token_ids=inference_pb2.TokenIds(ids=PROMPT),
        sampling=inference_pb2.SamplingOptions(max_tokens=8),
    )
    valid = await ModelCatalog().validate(request, routing.view.workers())
    now = time.monotonic()
    return RequestFlow(routing, valid, f"req-{uuid.uuid4().hex[:8]}", now, now + deadline_s)


async def run_flow(flow: RequestFlow) -> list[inference_pb2.GenerateResponse]:
    """Everything the client receives; a FlowError escapes as the client's status would."""
    async with asyncio.timeout(DEADLINE_S + 5.0):
        return [response async for response in flow.run()]


async def flow_error(flow: RequestFlow) -> FlowError:
    with pytest.raises(FlowError) as caught:
        await run_flow(flow)
    return caught.value


def token_ids(responses: Sequence[inference_pb2.GenerateResponse]) -> list[int]:
    return [t for response in responses for t in response.token_ids]


def final_of(responses: Sequence[inference_pb2.GenerateResponse]) -> inference_pb2.Final:
    assert [r.HasField("final") for r in responses] == [False] * (len(responses) - 1) + [True]
    return responses[-1].final


# ---- prefill -------------------------------------------------------------------------------------


def test_prefill_is_retried_once_on_another_worker_after_unavailable(
    etcd_url: str, model: str, caplog: pytest.LogCaptureFixture
) -> None:
    failing = FakeWorker("p1", "prefill", Script(prefill_error=grpc.StatusCode.UNAVAILABLE))
    healthy = FakeWorker("p2", "prefill", load=BUSY_PREFILL)
    decode = FakeWorker("d1", "decode")

    async def body() -> tuple[str, list[inference_pb2.GenerateResponse]]:
        async with serving(etcd_url, model, [failing, healthy, decode]) as routing:
            flow = await new_flow(routing, model)
            return flow.request_id, await run_flow(flow)

    with caplog.at_level(logging.WARNING, logger="pdserve.frontend.prefill_step"):
        request_id, responses = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert token_ids(responses) == [FIRST_TOKEN_ID, 11, 12, 13]
    breakdown = final_of(responses).breakdown
    assert (breakdown.prefill_attempts, breakdown.prefill_worker, breakdown.decode_worker) == (2, "p2", "d1")
    assert [len(failing.prefills), len(healthy.prefills)] == [1, 1]
    # The call opened beside the first prefill was cancelled with it; the second one knew where the KV was.
    assert [d.kv_source.worker_id for d in decode.pending_decodes] == ["p1"]
    assert [d.kv_source.worker_id for d in decode.decodes] == ["p2"] and not decode.decodes[0].kv_source.pending
    assert (failing.prefills[0].kv_consumer, healthy.prefills[0].kv_consumer) == (decode.endpoint, "")
    assert any(request_id in r.getMessage() and "p1" in r.getMessage() for r in caplog.records)
    assert failing.releases == healthy.releases == []


def test_a_non_retryable_prefill_error_is_final_and_keeps_its_code(etcd_url: str, model: str) -> None:
    refusing = FakeWorker("p1", "prefill", Script(prefill_error=grpc.StatusCode.INVALID_ARGUMENT))
    healthy = FakeWorker("p2", "prefill", load=BUSY_PREFILL)
    decode = FakeWorker("d1", "decode")

    async def body() -> FlowError:
        async with serving(etcd_url, model, [refusing, healthy, decode]) as routing:
            return await flow_error(await new_flow(routing, model))

    error = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "scripted failure on p1" in error.message
    assert [len(refusing.prefills), len(healthy.prefills), len(decode.decodes)] == [1, 0, 0]


def test_prefill_failing_on_every_worker_is_unavailable_naming_them(etcd_url: str, model: str) -> None:
    prefills = [FakeWorker(f"p{i}", "prefill", Script(prefill_error=grpc.StatusCode.UNAVAILABLE)) for i in (1, 2)]
    decode = FakeWorker("d1", "decode")

    async def body() -> FlowError:
        async with serving(etcd_url, model, [*prefills, decode]) as routing:
            return await flow_error(await new_flow(routing, model))

    error = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "p1" in error.message and "p2" in error.message
    assert [len(p.prefills) for p in prefills] == [1, 1]
    assert decode.decodes == []


def test_kv_heads_that_do_not_divide_over_the_decode_group_are_refused_before_any_call(
    etcd_url: str, model: str
) -> None:
    # 2 KV heads cannot spread over 4 decode ranks (each would hold a replica the pull cannot fill).
    prefill = FakeWorker("p1", "prefill", tensor_parallel_size=2, num_kv_heads=2)
    decode = FakeWorker("d1", "decode", tensor_parallel_size=4, num_kv_heads=2)

    async def body() -> FlowError:
        async with serving(etcd_url, model, [prefill, decode]) as routing:
            return await flow_error(await new_flow(routing, model))

    error = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "2 KV heads do not divide over decode worker d1's tensor-parallel size 4" in error.message
    assert "prefill tensor-parallel size 2, decode 4" in error.message
    assert (prefill.prefills, decode.decodes) == ([], [])


def test_conditional_disaggregation_falls_back_to_the_decode_worker_when_the_only_prefill_worker_fails(
    etcd_url: str, model: str
) -> None:
    failing = FakeWorker("p1", "prefill", Script(prefill_error=grpc.StatusCode.UNAVAILABLE))
    decode = FakeWorker("d1", "decode")

    async def body() -> list[inference_pb2.GenerateResponse]:
        async with serving(etcd_url, model, [failing, decode], disaggregation="conditional") as routing:
            return await run_flow(await new_flow(routing, model))

    responses = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert token_ids(responses) == [11, 12, 13]  # no first token from a prefill worker
    breakdown = final_of(responses).breakdown
    assert (breakdown.disaggregated, breakdown.prefill_worker, breakdown.decode_worker) == (False, "d1", "d1")
    assert len(failing.prefills) == 1
    assert [d.HasField("kv_source") for d in decode.decodes] == [False]  # the prompt is computed there


# ---- decode --------------------------------------------------------------------------------------


def test_the_decode_call_opens_while_the_prompt_computes_and_learns_where_the_kv_is(etcd_url: str, model: str) -> None:
    prefill = FakeWorker("p1", "prefill", Script(first_token_id=5, prefill_s=0.5, silent_prefill=True))
    decode = FakeWorker("d1", "decode")

    async def body() -> list[inference_pb2.GenerateResponse]:
        async with serving(etcd_url, model, [prefill, decode]) as routing:
            flow = await new_flow(routing, model)
            running = asyncio.ensure_future(run_flow(flow))
            await eventually(lambda: len(decode.pending_decodes) == 1, 5.0, "a decode call opened")
            assert prefill.num_in_flight == 1 and decode.decodes == []  # the prompt still computes
            opened = decode.pending_decodes[0]
            assert (opened.request_id, list(opened.prompt_token_ids)) == (flow.request_id, PROMPT)
            assert opened.kv_source.worker_id == "p1" and opened.kv_source.peer_info == b"fake-nixl-p1"
            assert prefill.prefills[0].kv_consumer == decode.endpoint  # told whom to announce the KV to
            return await running

    responses = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert token_ids(responses) == [5, 11, 12, 13]
    # The prefill worker's KVReady was lost: the frontend's own, sent after a wait, completed the call.
    [ready] = decode.kv_readies
    source = ready.kv_source
    assert (source.worker_id, list(source.block_ids), source.first_token_id) == ("p1", [0, 1], 5)
    assert 25.0 < source.pull_within_s < 30.0  # the pin's 30 s, less the margin and the time since
    assert [len(decode.decodes), decode.decodes[0].kv_source.pending] == [1, True]


def test_a_client_gone_during_the_prefill_leaves_no_decode_call_open(etcd_url: str, model: str) -> None:
    prefill = FakeWorker("p1", "prefill", Script(stall=True))
    decode = FakeWorker("d1", "decode")

    async def body() -> None:
        async with serving(etcd_url, model, [prefill, decode]) as routing:
            running = asyncio.ensure_future(run_flow(await new_flow(routing, model)))
            await eventually(
                lambda: len(decode.pending_decodes) == 1 and prefill.num_in_flight == 1, 5.0, "both calls open"
            )
            await cancel_and_wait(running)
            await eventually(lambda: decode.num_in_flight == prefill.num_in_flight == 0, 5.0, "both calls ended")
            assert decode.decode_cancelled.is_set() and decode.decodes == []

    run_scenario(body(), SCENARIO_TIMEOUT_S)


def test_a_draining_decode_worker_hands_the_request_to_another_in_one_stream(etcd_url: str, model: str) -> None:
    prefill = FakeWorker("p1", "prefill")
    # Its entry does not say draining yet (the registry lags): the router picks it, and it refuses.
    draining = FakeWorker("d1", "decode", Script(draining=True))
    taker = FakeWorker("d2", "decode", Script(tokens=(21, 22)), load=BUSY_DECODE)

    async def body() -> list[inference_pb2.GenerateResponse]:
        async with serving(etcd_url, model, [prefill, draining, taker]) as routing:
            return await run_flow(await new_flow(routing, model))

    responses = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert token_ids(responses) == [FIRST_TOKEN_ID, 21, 22]
    assert final_of(responses).breakdown.decode_worker == "d2"
    assert [len(draining.decodes), len(taker.decodes)] == [1, 1]
    assert taker.decodes[0].kv_source.worker_id == "p1"
    assert prefill.releases == []  # d2 pulled the blocks; its notice frees them


def test_requests_arriving_together_spread_over_the_decode_workers_while_they_prefill(
    etcd_url: str, model: str
) -> None:
    """A request counts against its decode worker from the moment it is routed, not from its
    decode call: eight arrivals during one long prefill land four and four."""
    prefill = FakeWorker("p1", "prefill", Script(prefill_s=0.5))
    decodes = [FakeWorker("d1", "decode"), FakeWorker("d2", "decode")]

    async def body() -> None:
        async with serving(etcd_url, model, [prefill, *decodes]) as routing:
            flows = [await new_flow(routing, model) for _ in range(8)]
            await asyncio.gather(*(run_flow(flow) for flow in flows))

    run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert [len(d.decodes) for d in decodes] == [4, 4]


# ---- release -------------------------------------------------------------------------------------


async def refused_everywhere(routing: Routing, model: str, decode: FakeWorker) -> RequestFlow:
    """Every decode worker refuses as draining: the request waits for another (one may be on
    its way, as in a rolling update) and fails at its deadline, before any pulled."""
    flow = await new_flow(routing, model, deadline_s=2.0)
    error = await flow_error(flow)
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED and "decode failed on d1" in error.message
    return flow


async def stops_after_the_first_token(routing: Routing, model: str, decode: FakeWorker) -> RequestFlow:
    """The client takes the first token and reads no further (the stream is closed)."""
    flow = await new_flow(routing, model)
    stream = flow.run()
    first = await asyncio.wait_for(anext(stream), DEADLINE_S)
    assert list(first.token_ids) == [FIRST_TOKEN_ID]
    await stream.aclose()
    return flow


async def cancels_while_decoding(routing: Routing, model: str, decode: FakeWorker) -> RequestFlow:
    """The client's call is cancelled while the decode worker is still pulling."""
    flow = await new_flow(routing, model)
    first_token = asyncio.Event()

    async def consume() -> None:
        async for _ in flow.run():
            first_token.set()

    task = asyncio.create_task(consume())
    try:
        await asyncio.wait_for(first_token.wait(), DEADLINE_S)
        await eventually(lambda: decode.num_in_flight == 1, DEADLINE_S, "the Decode call reached d1")
    finally:
        await cancel_and_wait(task)
    await eventually(lambda: decode.num_in_flight == 0, 5.0, "d1 saw its Decode call cancelled")
    return flow


@pytest.mark.parametrize(
    ("ending", "decode_script"),
    [
        (refused_everywhere, Script(draining=True)),
        (stops_after_the_first_token, Script(stall=True, tokens=())),
        (cancels_while_decoding, Script(pull_stalls=True)),
    ],
    ids=["decode-refused-everywhere", "client-stops-after-first-token", "client-cancels-while-decoding"],
)
def test_a_request_ending_before_decode_pulled_releases_the_prefill_worker_once(
    etcd_url: str, model: str, ending: Callable, decode_script: Script
) -> None:
    prefill = FakeWorker("p1", "prefill")
    decode = FakeWorker("d1", "decode", decode_script)

    async def body() -> str:
        async with serving(etcd_url, model, [prefill, decode]) as routing:
            flow = await ending(routing, model, decode)
            return flow.request_id

    request_id = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert [p.request_id for p in prefill.prefills] == [request_id]
    assert prefill.releases == [request_id]


def test_a_completed_decode_sends_no_release(etcd_url: str, model: str) -> None:
    prefill = FakeWorker("p1", "prefill")
    decode = FakeWorker("d1", "decode")

    async def body() -> list[inference_pb2.GenerateResponse]:
        async with serving(etcd_url, model, [prefill, decode]) as routing:
            return await run_flow(await new_flow(routing, model))

    responses = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert final_of(responses).finish_reason == "length"
    assert len(prefill.prefills) == 1
    assert prefill.releases == []


def test_a_client_gone_after_the_pull_sends_no_release(etcd_url: str, model: str) -> None:
    """Once the decode worker reported the pull, its completion notices free the pin: no Release."""
    prefill = FakeWorker("p1", "prefill")
    decode = FakeWorker("d1", "decode", Script(stall=True, tokens=(11,)))

    async def body() -> None:
        async with serving(etcd_url, model, [prefill, decode]) as routing:
            stream = (await new_flow(routing, model)).run()
            assert list((await asyncio.wait_for(anext(stream), DEADLINE_S)).token_ids) == [FIRST_TOKEN_ID]
            assert list((await asyncio.wait_for(anext(stream), DEADLINE_S)).token_ids) == [11]
            await stream.aclose()

    run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert len(prefill.prefills) == 1
    assert prefill.releases == []


# ---- deadline ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefill_script", "decode_script"),
    [(Script(stall=True), Script()), (Script(), Script(stall=True, tokens=(21,)))],
    ids=["prefill-stalls", "decode-stalls-mid-stream"],
)
def test_a_request_past_its_deadline_is_deadline_exceeded_and_leaves_no_call_behind(
    etcd_url: str, model: str, prefill_script: Script, decode_script: Script
) -> None:
    deadline_s = 1.0
    prefill = FakeWorker("p1", "prefill", prefill_script)
    decode = FakeWorker("d1", "decode", decode_script)

    async def body() -> tuple[FlowError, float]:
        async with serving(etcd_url, model, [prefill, decode]) as routing:
            flow = await new_flow(routing, model, deadline_s)
            with pytest.raises(FlowError) as caught:
                async with asyncio.timeout(deadline_s + 5.0):
                    async for _ in flow.run():
                        pass
            late_s = time.monotonic() - flow.deadline
            await eventually(
                lambda: prefill.num_in_flight == decode.num_in_flight == 0, 5.0, "the workers' calls ended"
            )
            return caught.value, late_s

    error, late_s = run_scenario(body(), SCENARIO_TIMEOUT_S)
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert late_s < 2.0, f"the flow gave up {late_s:.2f} s after its deadline"
