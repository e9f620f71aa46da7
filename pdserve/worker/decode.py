"""The decode role's Worker service: ``Decode``.

With a ``kv_source`` the request runs on the engine as a CONSUMER: it gets blocks (its own
prefix-cache hits first), the rest of the prompt's KV is pulled from the prefill worker, and
decoding continues from the prefill worker's first token. Without one the prompt is computed
here (conditional disaggregation, or a colocated deployment). Either way the stream ends with
a ``DecodeFinal``; a cancelled call aborts the request and frees its blocks.

A ``pending`` kv_source opens the call while the prompt is still being computed: the peer is
loaded, and the call waits in the ``KVMailbox`` for its ``KVReady`` (the prefill worker's, at
once, or the frontend's) before the request takes any blocks or seat. So the call's set-up
and the peer's loading are done by the time the KV is ready.

Prefill workers that leave the registry are dropped as NIXL peers at once, which fails their
in-flight pulls before the pulls' own deadlines.

In a group of ranks each rank pulls its own KV heads (``GroupPuller``); rank 0 resumes the
request once every rank's pull has succeeded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import msgspec

from pdserve.discovery.knobs import Knobs
from pdserve.discovery.knobs_follower import KnobsFollower
from pdserve.discovery.registry import WorkerEntry
from pdserve.discovery.registry_view import RegistryView
from pdserve.engine.engine_loop import EngineStopped, KVAwaited, RequestStream
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import KVRole
from pdserve.kvtransfer import KVPuller, LayoutMismatch, PeerInfo, TransferFailed, TransferStats, decode_group
from pdserve.rpc.logprobs import tokens_logprobs
from pdserve.rpc.sampling import sampling_params
from pdserve.rpc.status import KV_SOURCE_FAILED, refuse
from pdserve.v1 import worker_pb2
from pdserve.worker.group.pull import GroupPuller
from pdserve.worker.kv_mailbox import KVMailbox
from pdserve.worker.runtime import WorkerRuntime, WorkerServicer

logger = logging.getLogger(__name__)

# A pending call without a deadline of its own gives up on its KVReady after this long.
_PENDING_WAIT_S = 600.0


class DecodeService(WorkerServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        super().__init__(runtime)
        link = None if runtime.group is None else runtime.group.link
        self.puller = GroupPuller(KVPuller(runtime.agent, deadline_s=runtime.config.transfer_timeout_s), link)
        self.view = RegistryView(runtime.etcd)
        self.mailbox = KVMailbox()
        self._removals: set[asyncio.Task[None]] = set()  # peer removals under way (owned here)

    async def start(self) -> None:
        await self.view.start()
        self.view.add_listener(self._on_registry_change)

    async def close(self) -> None:
        await self.view.close()
        await self.puller.close()
        await asyncio.gather(*self._removals, return_exceptions=True)

    @property
    def num_waiting(self) -> int:
        """Decode calls waiting for their KVReady."""
        return self.mailbox.num_waiting

    def knobs_follower(self, apply: Callable[[Knobs | None], Awaitable[None]]) -> KnobsFollower:
        # The view watches every model's knobs already: one watch serves both.
        return KnobsFollower.from_view(self.view, self.runtime.config.served_model_name, apply)

    def _on_registry_change(self, added: list[WorkerEntry], removed: list[WorkerEntry]) -> None:
        agent, group = self.runtime.agent, self.runtime.group
        for entry in removed:
            try:
                names = [peer.agent_name for peer in decode_group(entry.nixl)]
            except msgspec.DecodeError:
                continue  # not a peer this worker could have loaded
            if group is not None:
                group.link.forget_peers(names)
            for name in names:
                if agent.has_peer(name):
                    task = asyncio.get_running_loop().create_task(agent.remove_peer(name, "left the registry"))
                    self._removals.add(task)
                    task.add_done_callback(self._removals.discard)

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        received_at = time.monotonic()
        await self.runtime.admin.check_caller(context, "Decode")
        await self.refuse_if_draining(context)
        source = request.kv_source if request.HasField("kv_source") else None
        try:
            params = sampling_params(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        peers = await self._peer(source, context) if source is not None else None
        if source is not None and source.pending:
            source = await self._await_kv(request.request_id, source, context)
            received_at = time.monotonic()  # the hand-off's admission starts with the KV ready
        engine_loop = self.runtime.engine_loop
        request_id = request.request_id
        role = KVRole.CONSUMER if source is not None else KVRole.LOCAL
        try:
            stream = await engine_loop.add(
                request_id,
                list(request.prompt_token_ids),
                params,
                role,
                generated_token_ids=list(request.generated_token_ids),
                cache_salt=request.cache_salt or None,
            )
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineStopped as exc:  # its worker is failing: another decode worker may take it
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.runtime.worker_id}: {exc}")
        done = False
        stats: TransferStats | None = None
        resumed_at: float | None = None  # the KV landed: the resume's wait for a step begins
        try:
            if source is not None and peers is not None:
                started, stats, ended = await self._pull(request_id, source, peers, stream, received_at, context)
                if ended is not None:  # the engine ended the request before it got blocks
                    await self._refuse_if_failed(ended, context)
                    yield self._response(ended, source, stats, is_first=False)
                    done = True
                    return
                resumed_at = time.monotonic()
                yield worker_pb2.DecodeResponse(started=started)
            num_resumed = len(request.generated_token_ids)
            async for output in stream.outputs():
                await self._refuse_if_failed(output, context)
                if resumed_at is not None:
                    self.runtime.metrics.resume_seconds.observe(time.monotonic() - resumed_at)
                    resumed_at = None
                num_new = len(output.new_token_ids)
                is_first = num_new > 0 and len(output.token_ids) == num_resumed + num_new
                response = self._response(output, source, stats, is_first)
                if source is None and is_first:
                    response.started.CopyFrom(self._local_start(output))  # with the first token
                yield response
            done = True
        finally:
            if not done:
                engine_loop.abort(request_id)

    async def KVReady(
        self, request: worker_pb2.KVReadyRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KVReadyResponse:
        """A pending Decode call's KV is ready: hand it to the call (or keep it for the call)."""
        await self.runtime.admin.check_caller(context, "KVReady")
        source = request.kv_source
        for name, value in (
            ("request_id", request.request_id),
            ("kv_source.worker_id", source.worker_id),
            ("kv_source.block_ids", source.block_ids),
        ):
            if not value:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"KVReady needs {name}")
        return worker_pb2.KVReadyResponse(accepted=self.mailbox.deliver(request.request_id, source))

    async def _await_kv(
        self, request_id: str, pending: worker_pb2.KVSource, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KVSource:
        """The pending source completed by its KVReady, within the call's deadline."""
        remaining = context.time_remaining()
        # With a deadline, the deadline ends the call (DEADLINE_EXCEEDED): this wait outlasts it.
        timeout_s = _PENDING_WAIT_S if remaining is None else remaining + 1.0
        try:
            ready = await self.mailbox.receive(request_id, pending.worker_id, timeout_s)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except TimeoutError:
            await refuse(
                context, KV_SOURCE_FAILED, f"{request_id}: no KVReady from {pending.worker_id} within {timeout_s:.0f} s"
            )
        source = worker_pb2.KVSource()
        source.CopyFrom(ready)
        source.peer_info = pending.peer_info
        return source

    async def _refuse_if_failed(self, output: RequestOutput, context: grpc.aio.ServicerContext) -> None:
        """An abort that is not the request's end, because its worker failed (a rank died),
        whether it was decoding or still waiting for blocks: UNAVAILABLE has the frontend move
        the stream to another decode worker."""
        engine_loop = self.runtime.engine_loop
        if output.finished and output.finish_reason == "abort" and engine_loop.error is not None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"decode of {output.request_id} on {self.runtime.worker_id} stopped: {engine_loop.error}",
            )

    async def _peer(  # type: ignore[return]  # context.abort raises
        self, source: worker_pb2.KVSource, context: grpc.aio.ServicerContext
    ) -> list[PeerInfo]:
        """The prefill group's ranks (one for a single-rank worker), loaded into this rank's agent."""
        agent = self.runtime.agent
        try:
            infos = decode_group(source.peer_info)
        except msgspec.DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"kv_source.peer_info does not decode: {exc}")
        # Always through add_peer: a peer known by this name but with other metadata is a restarted
        # process (same worker id, same address): its old NIXL state is dropped and it is loaded anew.
        # Every rank's, though this rank may read from some only: the puller checks the whole group.
        try:
            return [await agent.add_peer(info) for info in infos]
        except LayoutMismatch as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV layout of {source.worker_id}: {exc}")
        except Exception as exc:  # NIXL raises its own types; a prefill worker that died meanwhile is one cause
            # Typed, so the frontend prefills again elsewhere and keeps this worker for the decode.
            await refuse(context, KV_SOURCE_FAILED, f"loading {source.worker_id} as a NIXL peer failed: {exc}")

    async def _pull(
        self,
        request_id: str,
        source: worker_pb2.KVSource,
        peers: list[PeerInfo],
        stream: RequestStream,
        received_at: float,
        context: grpc.aio.ServicerContext,
    ) -> tuple[worker_pb2.DecodeStarted, TransferStats | None, RequestOutput | None]:
        """Wait for blocks (there at once unless seats or blocks are short), pull the KV into
        them, resume decoding; or the engine's own end. ``queue_ms``: the call's receipt to
        the pull's start, the hand-off's admission."""
        item = await stream.next()
        if isinstance(item, RequestOutput):
            return worker_pb2.DecodeStarted(), None, item
        assert isinstance(item, KVAwaited)
        queue_s = time.monotonic() - received_at
        remaining = received_at + source.pull_within_s - time.monotonic()
        if remaining <= 0:
            self.runtime.engine_loop.abort(request_id)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"{request_id} waited for KV blocks past its pin on {source.worker_id}"
            )
        block_size = self.runtime.engine.kv_cache_spec.block_size
        try:
            stats = await self.puller.pull(
                request_id,
                peers,
                list(source.block_ids),
                item.block_ids,
                num_cached_blocks=item.num_cached_tokens // block_size,
                deadline_s=min(remaining, self.puller.deadline_s),
            )
        except TransferFailed as exc:
            self.runtime.engine_loop.abort(request_id)
            # Typed, so the frontend prefills again elsewhere and keeps this worker for the decode.
            await refuse(context, KV_SOURCE_FAILED, f"KV pull from {source.worker_id} failed: {exc.reason}")
        await self.runtime.engine_loop.kv_received(request_id, source.first_token_id)
        started = worker_pb2.DecodeStarted(
            num_cached_tokens=item.num_cached_tokens,
            queue_ms=queue_s * 1e3,
            kv_transfer_ms=stats.seconds * 1e3,
            kv_transfer_bytes=stats.num_bytes,
        )
        return started, stats, None

    @staticmethod
    def _local_start(output: RequestOutput) -> worker_pb2.DecodeStarted:
        """How a prompt computed here began: its queue and compute time, its prefix-cache hits."""
        scheduled = output.first_scheduled_time or output.arrival_time
        return worker_pb2.DecodeStarted(
            num_cached_tokens=output.num_cached_tokens,
            queue_ms=(scheduled - output.arrival_time) * 1e3,
            prefill_ms=((output.first_token_time or scheduled) - scheduled) * 1e3,
        )

    def _record(
        self, output: RequestOutput, scheduled: float, local_prefill_ms: float, stats: TransferStats | None
    ) -> None:
        metrics = self.runtime.metrics
        metrics.queue_seconds.observe(scheduled - output.arrival_time)
        metrics.prompt_admitted(output.num_prompt_tokens, output.num_cached_tokens)
        if stats is None:
            metrics.prefill_seconds.observe(local_prefill_ms / 1e3)
        else:
            metrics.kv_transfer_seconds.observe(stats.seconds)
            metrics.kv_transfer_bytes.inc(stats.num_bytes)
        metrics.request_ended(output.finish_reason or "abort")

    def _response(
        self, output: RequestOutput, source: worker_pb2.KVSource | None, stats: TransferStats | None, is_first: bool
    ) -> worker_pb2.DecodeResponse:
        """``is_first``: ``output`` holds the request's first token here (after any it resumed with)."""
        new_tokens, new_logprobs = output.new_token_ids, output.new_logprobs
        if source is not None and is_first:
            # The first token (and its logprobs) came from the prefill worker; never send it twice.
            new_tokens, new_logprobs = new_tokens[1:], new_logprobs[1:]
        response = worker_pb2.DecodeResponse(token_ids=new_tokens, logprobs=tokens_logprobs(new_logprobs))
        if output.finished:
            scheduled = output.first_scheduled_time or output.arrival_time
            local_prefill_ms = ((output.first_token_time or scheduled) - scheduled) * 1e3 if source is None else 0.0
            self._record(output, scheduled, local_prefill_ms, stats)
            response.final.CopyFrom(worker_pb2.DecodeFinal(finish_reason=output.finish_reason or "abort"))
        return response
