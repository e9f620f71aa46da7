"""Scripted ``pdserve.v1.Worker``s on real grpc.aio servers, registered in a real etcd, and the
frontend's routing over them (``serving``).

No model, no engine, no NIXL: each call is answered the way its ``Script`` says, and every
call it receives is recorded, so a test can check what a worker was really sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from pdserve.discovery.etcd import EtcdConnection
from pdserve.discovery.registration import WorkerRegistration
from pdserve.discovery.registry import WorkerEntry
from pdserve.discovery.registry_view import RegistryView
from pdserve.frontend.channels import WorkerChannels
from pdserve.frontend.config import RouterConfig
from pdserve.frontend.router import Router
from pdserve.frontend.routing import Routing
from pdserve.rpc.server import RpcServer
from pdserve.rpc.status import DRAINING, KV_SOURCE_FAILED, refuse
from pdserve.types.engine_load import EngineLoad
from pdserve.v1 import worker_pb2, worker_pb2_grpc

FIRST_TOKEN_ID = 7  # what a fake prefill worker answers unless its script says otherwise
COUNTING_BASE = 100  # a counting script's first output token
VOCAB_SIZE = 1000
MAX_MODEL_LEN = 1024
_STOP_GRACE_S = 1.0


async def refuse_as_draining(context: grpc.aio.ServicerContext, worker_id: str) -> None:
    """Refuse a call the way a draining worker does (``WorkerServicer.refuse_if_draining``).

    The one place the fakes signal draining, so that a change of that signal is one edit here.
    """
    await refuse(context, DRAINING, f"worker {worker_id} takes no new requests")


async def refuse_untyped(context: grpc.aio.ServicerContext, worker_id: str) -> None:
    """The same status and details as ``refuse_as_draining``, but no typed refusal."""
    await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {worker_id} takes no new requests")


@dataclass(frozen=True)
class Script:
    """How a fake worker answers; the defaults answer every call at once.

    Attributes:
        prefill_error: fail every Prefill with this code.
        draining: refuse every Prefill and Decode as a draining worker does.
        untyped_refusal: with ``draining``, refuse without saying why (``refuse_untyped``).
        first_token_id: what Prefill answers.
        prefill_s: Prefill takes this long, as a prompt being computed does.
        silent_prefill: Prefill does not send its ``kv_consumer`` the ``KVReady`` a real prefill
            worker sends (as if it were lost), so only the frontend's reaches the decode worker.
        tokens: Decode streams these, one a message, then its final message (a migrated request:
            those after the ones it was generated).
        token_gap_s: Decode waits this long before each token after the first.
        decode_error: Decode fails with this code after ``tokens`` instead of finishing.
        stall: answer no Prefill, and send nothing after ``tokens`` in Decode, until the
            caller cancels the call or its deadline passes.
        pull_stalls: Decode from a ``kv_source`` never finishes its pull: it sends nothing,
            not even the ``DecodeStarted`` a real decode worker sends once the pull is done.
        counting: the request's n-th output token is ``COUNTING_BASE + n`` (a model whose
            continuation is checkable): Prefill answers the one after its ``generated_token_ids``,
            Decode streams those after its own (and the kv_source's) up to ``max_tokens``; ``tokens``
            is not used.
        fail_after: Decode fails with UNAVAILABLE, as a dying worker's stream does, after streaming
            this many tokens.
        failed_pulls: Decode refuses this many of its first calls that carry a ``kv_source`` with
            ``KV_SOURCE_FAILED``, as a decode worker whose pull from a dead prefill worker failed.
    """

    prefill_error: grpc.StatusCode | None = None
    draining: bool = False
    untyped_refusal: bool = False
    first_token_id: int = FIRST_TOKEN_ID
    prefill_s: float = 0.0
    silent_prefill: bool = False
    tokens: tuple[int, ...] = (11, 12, 13)
    token_gap_s: float = 0.0
    decode_error: grpc.StatusCode | None = None
    stall: bool = False
    pull_stalls: bool = False
    counting: bool = False
    fail_after: int | None = None
    failed_pulls: int = 0


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """One worker of one role; ``start`` serves it and registers it, ``stop`` undoes both.

    ``load`` is what its registry entry reports (the router prefers the less loaded).
    """

    def __init__(
        self,
        worker_id: str,
        role: str,
        script: Script = Script(),
        load: EngineLoad = EngineLoad(),
        tensor_parallel_size: int = 1,
        num_kv_heads: int = 0,
        group: tuple[str, int, int] = ("", 1, 0),
    ) -> None:
        """``tensor_parallel_size`` and ``num_kv_heads``: the KV heads' spread its entry reports;
        ``group``: its data-parallel group's id and size, and its rank there, as its entry reports."""
        self.worker_id = worker_id
        self.group = group
        self.tensor_parallel_size = tensor_parallel_size
        self.num_kv_heads = num_kv_heads
        self.role = role
        self.script = script
        self.load = load
        self.prefills: list[worker_pb2.PrefillRequest] = []
        # Decode calls as they started: a pending one once its KVReady came, completed by it.
        self.decodes: list[worker_pb2.DecodeRequest] = []
        self.pending_decodes: list[worker_pb2.DecodeRequest] = []  # those opened pending, as they opened
        self.releases: list[str] = []  # request ids, in the order their Release calls came
        self.kv_readies: list[worker_pb2.KVReadyRequest] = []
        self._ready: dict[str, asyncio.Future[worker_pb2.KVSource]] = {}  # by request id
        self.num_in_flight = 0  # calls being handled now
        self.decode_cancelled = asyncio.Event()  # a Decode call was cancelled while it streamed
        self.endpoint = ""  # once started
        self._server: RpcServer | None = None
        self._registration: WorkerRegistration | None = None
        self._etcd: EtcdConnection | None = None
        self._entry: WorkerEntry | None = None

    async def start(self, etcd_url: str, model: str, model_path: str = "/nonexistent/fake-model") -> None:
        self._server = RpcServer()
        self._server.add(lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(self, s), "pdserve.v1.Worker")
        port = await self._server.start("127.0.0.1", 0)
        self.endpoint = f"127.0.0.1:{port}"
        entry = WorkerEntry(
            worker_id=self.worker_id,
            role=self.role,
            model=model,
            model_path=model_path,
            endpoint=self.endpoint,
            nixl=b"fake-nixl-" + self.worker_id.encode(),
            block_size=4,
            num_kv_blocks=256,
            max_model_len=MAX_MODEL_LEN,
            vocab_size=VOCAB_SIZE,
            max_num_seqs=8,
            started_at=time.time(),
            tensor_parallel_size=self.tensor_parallel_size,
            num_kv_heads=self.num_kv_heads,
            group_id=self.group[0],
            group_size=self.group[1],
            group_rank=self.group[2],
        )
        self._etcd = EtcdConnection(etcd_url)
        self._entry = entry
        await self.register()

    async def register(self) -> None:
        """Register (again, after ``leave``) under the same id and endpoint."""
        assert self._etcd is not None and self._entry is not None, "start() first"
        self._registration = WorkerRegistration(
            self._etcd, self._entry, lambda: self.load, ttl_s=5.0, start_timeout_s=10.0
        )
        await self._registration.start()

    async def leave(self) -> None:
        """Leave the registry and go on serving, as every worker does when the registry loses its data."""
        if self._registration is not None:
            await self._registration.close()
            self._registration = None

    async def stop(self) -> None:
        if self._registration is not None:
            await self._registration.close()
            self._registration = None
        if self._etcd is not None:
            await self._etcd.close()
            self._etcd = None
        if self._server is not None:
            await self._server.stop(_STOP_GRACE_S)
            self._server = None

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        self.prefills.append(request)
        self.num_in_flight += 1
        try:
            if self.script.draining:
                await self._refuse(context)
            if self.script.prefill_error is not None:
                await context.abort(self.script.prefill_error, f"scripted failure on {self.worker_id}")
            if self.script.stall:
                await asyncio.Event().wait()
            await asyncio.sleep(self.script.prefill_s)
            num_generated = len(request.generated_token_ids)
            if self.script.counting:
                first = COUNTING_BASE + num_generated
            else:  # the output is the first token, then ``tokens``
                first = [self.script.first_token_id, *self.script.tokens][num_generated]
            if request.kv_consumer and not self.script.silent_prefill:  # as a real prefill worker does
                source = worker_pb2.KVSource(
                    worker_id=self.worker_id, block_ids=[0, 1], first_token_id=first, pull_within_s=28.0
                )
                async with grpc.aio.insecure_channel(request.kv_consumer) as channel:
                    await worker_pb2_grpc.WorkerStub(channel).KVReady(
                        worker_pb2.KVReadyRequest(request_id=request.request_id, kv_source=source), timeout=5.0
                    )
            return worker_pb2.PrefillResponse(
                worker_id=self.worker_id, first_token_id=first, block_ids=[0, 1], hold_seconds=30.0
            )
        finally:
            self.num_in_flight -= 1

    async def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseResponse:
        held = any(p.request_id == request.request_id for p in self.prefills)
        self.releases.append(request.request_id)
        return worker_pb2.ReleaseResponse(released=held)

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        self.num_in_flight += 1
        try:
            if self.script.draining:
                self.decodes.append(request)
                await self._refuse(context)
            if request.kv_source.pending:  # as a real decode worker, wait for its KVReady
                self.pending_decodes.append(request)
                request.kv_source.MergeFrom(await self._kv_ready(request.request_id))
            self.decodes.append(request)
            if request.HasField("kv_source"):
                if sum(d.HasField("kv_source") for d in self.decodes) <= self.script.failed_pulls:
                    source = request.kv_source.worker_id
                    await refuse(context, KV_SOURCE_FAILED, f"KV pull from {source} failed: remote disconnected")
                if self.script.pull_stalls:
                    await asyncio.Event().wait()
                # A real decode worker reports the pull as soon as it is done.
                yield worker_pb2.DecodeResponse(started=worker_pb2.DecodeStarted(kv_transfer_ms=1.0))
            for index, token_id in enumerate(self._tokens(request)):
                if index == self.script.fail_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker_id} died")
                if index and self.script.token_gap_s:
                    await asyncio.sleep(self.script.token_gap_s)
                yield worker_pb2.DecodeResponse(token_ids=[token_id])
            if self.script.decode_error is not None:
                await context.abort(self.script.decode_error, f"scripted failure on {self.worker_id}")
            if self.script.stall:
                await asyncio.Event().wait()
            yield worker_pb2.DecodeResponse(final=worker_pb2.DecodeFinal(finish_reason="length"))
        except asyncio.CancelledError:
            self.decode_cancelled.set()
            raise
        finally:
            self.num_in_flight -= 1

    async def KVReady(
        self, request: worker_pb2.KVReadyRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KVReadyResponse:
        self.kv_readies.append(request)
        waiter = self._ready.setdefault(request.request_id, asyncio.get_running_loop().create_future())
        if waiter.done():
            return worker_pb2.KVReadyResponse(accepted=False)
        waiter.set_result(request.kv_source)
        return worker_pb2.KVReadyResponse(accepted=True)

    async def _kv_ready(self, request_id: str) -> worker_pb2.KVSource:
        return await self._ready.setdefault(request_id, asyncio.get_running_loop().create_future())

    def _tokens(self, request: worker_pb2.DecodeRequest) -> list[int]:
        """What Decode streams: the output after what the request was generated (and the kv_source's token)."""
        num_generated = len(request.generated_token_ids)
        if self.script.counting:
            start = num_generated + request.HasField("kv_source")
            return [COUNTING_BASE + n for n in range(start, request.sampling.max_tokens)]
        # Prefilled, the output is the first token, then ``tokens``; computed here, ``tokens``.
        return list(self.script.tokens[num_generated:])

    async def _refuse(self, context: grpc.aio.ServicerContext) -> None:
        if self.script.untyped_refusal:
            await refuse_untyped(context, self.worker_id)
        await refuse_as_draining(context, self.worker_id)


@asynccontextmanager
async def serving(
    etcd_url: str,
    model: str,
    workers: Sequence[FakeWorker],
    disaggregation: str = "always",
    model_path: str = "/nonexistent/fake-model",
    max_migrations: int = 2,
    migration_wait_s: float = 30.0,
) -> AsyncIterator[Routing]:
    """Start and register ``workers`` (serving ``model`` from ``model_path``, where the frontend
    looks for its tokenizer); yield the frontend's routing over them (``max_migrations`` a flow, each waiting
    ``migration_wait_s`` for a decode worker when none is left).

    On the way out the channels are closed first, which waits for the flow's background
    Releases, so the workers' records are complete once the block is left.
    """
    etcd = EtcdConnection(etcd_url)
    view = RegistryView(etcd)
    config = RouterConfig(disaggregation=disaggregation, local_prefill_threshold_tokens=0)
    routing = Routing(view, Router(config, seed=0), WorkerChannels(), max_migrations, migration_wait_s)
    try:
        for worker in workers:
            await worker.start(etcd_url, model, model_path)
        await view.start()
        assert sorted(w.worker_id for w in view.workers(model=model)) == sorted(w.worker_id for w in workers)
        yield routing
    finally:
        await routing.channels.close_all()
        await view.close()
        await etcd.close()
        for worker in workers:
            await worker.stop()
