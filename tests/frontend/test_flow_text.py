"""A request's text, made by the frontend from the token ids its workers send.

The workers are ``fake_worker.FakeWorker``s (scripted, on real gRPC, registered in the real
etcd) serving a model whose directory holds a real tokenizer, so the frontend's side of the
contract is checked on its own: where the text comes from, when the frontend ends a decode
call itself, and what a draining worker's typed refusal allows.
"""

from __future__ import annotations

import time

import pytest

from pdserve.frontend.catalog import ModelCatalog
from pdserve.frontend.flow import RequestFlow
from pdserve.frontend.routing import Routing
from pdserve.text.tokenizer import Tokenizer
from pdserve.types.engine_load import EngineLoad
from pdserve.v1 import inference_pb2
from tests.frontend.fake_worker import FakeWorker, Script, serving
from tests.utils.aio import eventually, run_scenario
from tests.utils.tiny_tokenizer import write_tiny_tokenizer

TEXT = "Hello world, and more"  # tokens "Hello" | " world" | "," | " and" | ...


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(directory)
    return str(directory)


@pytest.fixture(scope="module")
def tokens(tokenizer_dir: str) -> list[int]:
    return Tokenizer.from_pretrained(tokenizer_dir).encode(TEXT, add_special_tokens=False)


def speaking(tokens: list[int], **script: object) -> Script:
    """Prefill answers the first of ``tokens``; Decode streams the rest, 50 ms apart."""
    return Script(first_token_id=tokens[0], tokens=tuple(tokens[1:]), token_gap_s=0.05, **script)


async def generate(routing: Routing, model: str, stop: list[str]) -> list[inference_pb2.GenerateResponse]:
    request = inference_pb2.GenerateRequest(
        model=model,
        token_ids=inference_pb2.TokenIds(ids=[5, 6, 7]),
        sampling=inference_pb2.SamplingOptions(max_tokens=16, temperature=0, stop=stop),
    )
    valid = await ModelCatalog().validate(request, routing.view.workers())
    assert valid.tokenizer is not None
    flow = RequestFlow(routing, valid, "r1", time.monotonic(), time.monotonic() + 30)
    return [message async for message in flow.run()]


def text_of(messages: list[inference_pb2.GenerateResponse]) -> tuple[list[int], str]:
    return [t for m in messages for t in m.token_ids], "".join(m.text for m in messages)


def test_a_stop_string_across_the_hand_off_ends_the_decode_call_and_the_frontend_sends_the_final(
    etcd_url, tokenizer_dir, tokens, model
):
    prefill, decode = FakeWorker("p1", "prefill", speaking(tokens)), FakeWorker("d1", "decode", speaking(tokens))

    async def main():
        async with serving(etcd_url, model, [prefill, decode], model_path=tokenizer_dir) as routing:
            messages = await generate(routing, model, ["lo wor"])
            await decode.decode_cancelled.wait()  # the decode call was ended, not run out
            return messages

    messages = run_scenario(main(), timeout_s=60)
    assert [m.text for m in messages] == ["Hel", ""]  # "lo" was held back at the hand-off, then cut
    assert text_of(messages)[0] == tokens[:2]  # " world" completed the stop; nothing after it is sent
    final = messages[-1].final
    assert (final.finish_reason, final.text, final.usage.completion_tokens) == ("stop", "Hel", 2)
    assert final.breakdown.disaggregated and final.breakdown.decode_worker == "d1"
    assert prefill.releases == []  # the decode worker pulled the KV: its notice released the blocks


def test_without_a_stop_the_first_token_reaches_the_client_once_and_the_held_text_at_the_end(
    etcd_url, tokenizer_dir, tokens, model
):
    prefill, decode = FakeWorker("p1", "prefill", speaking(tokens)), FakeWorker("d1", "decode", speaking(tokens))

    async def main():
        async with serving(etcd_url, model, [prefill, decode], model_path=tokenizer_dir) as routing:
            return await generate(routing, model, ["more!"])

    messages = run_scenario(main(), timeout_s=60)
    assert text_of(messages) == (tokens, TEXT)
    assert messages[0].text == "Hello" and messages[-1].text == "more"  # "more" may begin "more!": held to the end
    final = messages[-1].final
    assert (final.finish_reason, final.text, final.usage.completion_tokens) == ("length", TEXT, len(tokens))
    assert not decode.decode_cancelled.is_set()


def test_a_stop_string_in_the_first_token_ends_the_decode_call_and_releases_the_pin(
    etcd_url, tokenizer_dir, tokens, model
):
    prefill, decode = FakeWorker("p1", "prefill", speaking(tokens)), FakeWorker("d1", "decode", speaking(tokens))

    async def main():
        async with serving(etcd_url, model, [prefill, decode], model_path=tokenizer_dir) as routing:
            messages = await generate(routing, model, ["ell"])  # leaving waits for the background Release
            await eventually(lambda: decode.num_in_flight == 0, 5.0, "the decode call ended")
            return messages

    [message] = run_scenario(main(), timeout_s=60)
    assert (list(message.token_ids), message.text) == (tokens[:1], "H")
    assert (message.final.finish_reason, message.final.text, message.final.usage.completion_tokens) == ("stop", "H", 1)
    # The Decode call opened with the prefill was cancelled, and the pinned blocks are let go at once.
    assert len(decode.pending_decodes) == 1 and prefill.releases == ["r1"]


@pytest.mark.parametrize("refusal", ["typed", "untyped"])
def test_only_a_typed_draining_refusal_lets_another_decode_worker_take_the_request(
    etcd_url, tokenizer_dir, tokens, model, refusal
):
    prefill = FakeWorker("p1", "prefill", speaking(tokens))
    draining = FakeWorker("d1", "decode", speaking(tokens, draining=True, untyped_refusal=refusal == "untyped"))
    # The draining worker looks idle (its registry entry lags): the router tries it first.
    taker = FakeWorker("d2", "decode", speaking(tokens), load=EngineLoad(running=5))

    async def main():
        async with serving(etcd_url, model, [prefill, draining, taker], model_path=tokenizer_dir) as routing:
            return await generate(routing, model, [])

    messages = run_scenario(main(), timeout_s=60)
    assert text_of(messages) == (tokens, TEXT)
    breakdown = messages[-1].final.breakdown
    assert breakdown.decode_worker == "d2"
    if refusal == "untyped":  # the details read the same, but nothing says the call was refused unstarted:
        # the request migrates (a new prefill, the first attempt's pin released) instead of being handed over
        assert breakdown.migrations == 1 and breakdown.migration_history[0].from_worker == "d1"
        assert [p.request_id for p in prefill.prefills] == ["r1", "r1.m1"] and prefill.releases == ["r1"]
    else:
        assert breakdown.migrations == 0 and len(prefill.prefills) == 1
    assert (len(draining.decodes), len(taker.decodes)) == (1, 1)


@pytest.mark.parametrize("stop", [[], [", and"]], ids=["no-stop", "stop-across-the-migration"])
def test_a_migrated_stream_reads_as_one_text_and_a_stop_string_across_the_break_still_ends_it(
    etcd_url, tokenizer_dir, tokens, model, stop
):
    """d1 dies after " world" (its second token): d2 goes on from "," (the tokens already streamed
    are its generated_token_ids), and ", and" spans the two workers."""
    prefill = FakeWorker("p1", "prefill", speaking(tokens))
    dying = FakeWorker("d1", "decode", speaking(tokens, fail_after=1))
    taker = FakeWorker("d2", "decode", speaking(tokens), load=EngineLoad(running=5))

    async def main():
        async with serving(etcd_url, model, [prefill, dying, taker], model_path=tokenizer_dir) as routing:
            return await generate(routing, model, stop)

    messages = run_scenario(main(), timeout_s=60)
    final = messages[-1].final
    assert final.breakdown.migrations == 1 and final.breakdown.migration_history[0].tokens_streamed == 2
    assert list(taker.decodes[0].generated_token_ids) == tokens[:2]
    if not stop:
        assert text_of(messages) == (tokens, TEXT) and final.text == TEXT
        return
    ids, text = text_of(messages)
    assert (text, final.text, final.finish_reason) == ("Hello world", "Hello world", "stop")
    assert ids == tokens[: len(ids)] and final.usage.completion_tokens == len(ids)
