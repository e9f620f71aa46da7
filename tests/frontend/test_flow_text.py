"""A request's flow through workers that speak token ids: real etcd, real gRPC, scripted workers.

The workers here are small ``pdserve.v1.Worker`` servers whose replies are scripted, so that
the frontend's side of the contract is checked on its own: where the text comes from, when the
frontend ends a decode call itself, and what a draining worker's typed refusal allows.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import AsyncExitStack, asynccontextmanager

import grpc
import pytest

from pdserve.discovery.registration import WorkerRegistration
from pdserve.discovery.etcd import EtcdConnection
from pdserve.discovery.registry import WorkerEntry
from pdserve.engine.load import EngineLoad
from pdserve.discovery.registry_view import RegistryView
from pdserve.engine.tokenizer import Tokenizer
from pdserve.frontend.catalog import ModelCatalog
from pdserve.frontend.channels import WorkerChannels
from pdserve.frontend.config import RouterConfig
from pdserve.frontend.flow import FlowError, RequestFlow, Routing
from pdserve.frontend.router import Router
from pdserve.rpc.status import DRAINING, refuse
from pdserve.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tests.utils.aio import run_scenario
from tests.utils.tiny_tokenizer import write_tiny_tokenizer

TEXT = "Hello world, and more"  # tokens "Hello" | " world" | "," | " and" | ...


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(directory)
    return str(directory)


class ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    """Prefill answers ``tokens[0]``; Decode streams the rest one message at a time, or refuses.

    ``refusal``: "typed" refuses every Decode as draining (``pdserve.rpc.status``); "untyped"
    refuses with the same status and details but no typed refusal.
    """

    def __init__(self, tokens: list[int], refusal: str | None = None) -> None:
        self.tokens = tokens
        self.refusal = refusal
        self.num_decodes = 0
        self.released: list[str] = []
        self.cancelled = asyncio.Event()

    async def Prefill(self, request, context):
        return worker_pb2.PrefillResponse(worker_id="p1", first_token_id=self.tokens[0], hold_seconds=30.0)

    async def Release(self, request, context):
        self.released.append(request.request_id)
        return worker_pb2.ReleaseResponse(released=True)

    async def Decode(self, request, context):
        self.num_decodes += 1
        if self.refusal == "typed":
            await refuse(context, DRAINING, "draining: worker takes no new requests")
        if self.refusal == "untyped":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining: worker takes no new requests")
        rest = self.tokens[1:] if request.HasField("kv_source") else self.tokens
        if request.HasField("kv_source"):  # the pull is done, as a real decode worker reports
            yield worker_pb2.DecodeResponse(started=worker_pb2.DecodeStarted(kv_transfer_ms=1.0))
        try:
            for token in rest[:-1]:
                yield worker_pb2.DecodeResponse(token_ids=[token])
                await asyncio.sleep(0.05)
            yield worker_pb2.DecodeResponse(token_ids=rest[-1:], final=worker_pb2.DecodeFinal(finish_reason="length"))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@asynccontextmanager
async def cluster(etcd_url: str, tokenizer_dir: str, workers: dict[str, tuple[str, ScriptedWorker, int]]):
    """Serve and register each worker (id -> (role, servicer, running)); yield a routing over them."""
    model = f"flow-{uuid.uuid4().hex[:8]}"
    async with AsyncExitStack() as stack:
        etcd = EtcdConnection(etcd_url)
        stack.push_async_callback(etcd.close)
        for worker_id, (role, servicer, running) in workers.items():
            server = grpc.aio.server()
            worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            stack.push_async_callback(server.stop, None)
            entry = WorkerEntry(
                worker_id=worker_id, role=role, model=model, model_path=tokenizer_dir, endpoint=f"127.0.0.1:{port}",
                nixl=b"", block_size=16, num_kv_blocks=100, max_model_len=1024, vocab_size=1000, max_num_seqs=8,
                started_at=time.time(),
            )  # fmt: skip
            registration = WorkerRegistration(etcd, entry, lambda running=running: EngineLoad(running=running))
            await registration.start()
            stack.push_async_callback(registration.close)
        view = RegistryView(etcd)
        await view.start()
        stack.push_async_callback(view.close)
        channels = WorkerChannels()
        stack.push_async_callback(channels.close_all)
        yield Routing(view, Router(RouterConfig(disaggregation="always"), seed=0), channels)


async def generate(routing: Routing, tokenizer: Tokenizer, stop: list[str]) -> list[inference_pb2.GenerateResponse]:
    request = inference_pb2.GenerateRequest(
        token_ids=inference_pb2.TokenIds(ids=[5, 6, 7]),
        sampling=inference_pb2.SamplingOptions(max_tokens=16, temperature=0, stop=stop),
    )
    valid = ModelCatalog().validate(request, routing.view.workers())
    assert valid.tokenizer is not None
    flow = RequestFlow(routing, valid, "r1", time.monotonic(), time.monotonic() + 30)
    return [message async for message in flow.run()]


def text_of(messages: list[inference_pb2.GenerateResponse]) -> tuple[list[int], str]:
    return [t for m in messages for t in m.token_ids], "".join(m.text for m in messages)


def test_a_stop_string_across_the_hand_off_ends_the_decode_call_and_the_frontend_sends_the_final(
    etcd_url, tokenizer_dir
):
    tokenizer = Tokenizer.from_pretrained(tokenizer_dir)
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    worker = ScriptedWorker(tokens)

    async def main():
        async with cluster(etcd_url, tokenizer_dir, {"p1": ("prefill", worker, 0), "d1": ("decode", worker, 0)}) as r:
            messages = await generate(r, tokenizer, ["lo wor"])
            await asyncio.wait_for(worker.cancelled.wait(), 5)  # the decode call was ended, not run out
            return messages

    messages = run_scenario(main(), timeout_s=60)
    assert [m.text for m in messages] == ["Hel", ""]  # "lo" was held back at the hand-off, then cut
    assert text_of(messages)[0] == tokens[:2]  # " world" completed the stop; nothing after it is sent
    final = messages[-1].final
    assert (final.finish_reason, final.text, final.usage.completion_tokens) == ("stop", "Hel", 2)
    assert final.breakdown.disaggregated and final.breakdown.decode_worker == "d1"
    assert worker.released == []  # the decode worker pulled the KV: its notice released the blocks


def test_without_a_stop_the_first_token_reaches_the_client_once_and_the_held_text_at_the_end(
    etcd_url, tokenizer_dir
):
    tokenizer = Tokenizer.from_pretrained(tokenizer_dir)
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    worker = ScriptedWorker(tokens)

    async def main():
        async with cluster(etcd_url, tokenizer_dir, {"p1": ("prefill", worker, 0), "d1": ("decode", worker, 0)}) as r:
            return await generate(r, tokenizer, ["more!"])

    messages = run_scenario(main(), timeout_s=60)
    assert text_of(messages) == (tokens, TEXT)
    assert messages[0].text == "Hello" and messages[-1].text == "more"  # "more" may begin "more!": held to the end
    final = messages[-1].final
    assert (final.finish_reason, final.text, final.usage.completion_tokens) == ("length", TEXT, len(tokens))
    assert not worker.cancelled.is_set()


def test_a_stop_string_in_the_first_token_needs_no_decode_call(etcd_url, tokenizer_dir):
    tokenizer = Tokenizer.from_pretrained(tokenizer_dir)
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    worker = ScriptedWorker(tokens)

    async def main():
        async with cluster(etcd_url, tokenizer_dir, {"p1": ("prefill", worker, 0), "d1": ("decode", worker, 0)}) as r:
            messages = await generate(r, tokenizer, ["ell"])
            for _ in range(100):  # the release goes out in the background
                if worker.released:
                    break
                await asyncio.sleep(0.05)
            return messages

    [message] = run_scenario(main(), timeout_s=60)
    assert (list(message.token_ids), message.text) == (tokens[:1], "H")
    assert (message.final.finish_reason, message.final.text, message.final.usage.completion_tokens) == ("stop", "H", 1)
    assert worker.num_decodes == 0 and worker.released == ["r1"]  # the pinned blocks are let go at once


@pytest.mark.parametrize("refusal", ["typed", "untyped"])
def test_only_a_typed_draining_refusal_lets_another_decode_worker_take_the_request(
    etcd_url, tokenizer_dir, refusal
):
    tokenizer = Tokenizer.from_pretrained(tokenizer_dir)
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    prefill, draining, serving = ScriptedWorker(tokens), ScriptedWorker(tokens, refusal), ScriptedWorker(tokens)
    # The draining worker looks idle (its registry entry lags): the router tries it first.
    workers = {"p1": ("prefill", prefill, 0), "d1": ("decode", draining, 0), "d2": ("decode", serving, 5)}

    async def main():
        async with cluster(etcd_url, tokenizer_dir, workers) as r:
            return await generate(r, tokenizer, [])

    if refusal == "untyped":  # the details read the same, but nothing says the call was refused unstarted
        with pytest.raises(FlowError) as error:
            run_scenario(main(), timeout_s=60)
        assert error.value.code == grpc.StatusCode.UNAVAILABLE and "decode on d1 failed" in error.value.message
        assert (draining.num_decodes, serving.num_decodes) == (1, 0)
        return
    messages = run_scenario(main(), timeout_s=60)
    assert text_of(messages) == (tokens, TEXT)
    assert messages[-1].final.breakdown.decode_worker == "d2"
    assert (draining.num_decodes, serving.num_decodes) == (1, 1)
