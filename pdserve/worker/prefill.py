"""The prefill role's Worker service: ``Prefill`` and ``Release``.

A request runs on the engine as a PRODUCER: it stops after its first token and the engine keeps
its blocks pinned until the decode worker is done with them (its completion notices, which a
``SentReporter`` turns into the engine's "sent"), a ``Release``, or ``hold_s`` — whichever comes
first — and then gives them back to the pool (their prefix stays cached). In a group of ranks
each rank holds its heads of those blocks and hears its own notices; the pin is freed when
every rank's are in (``GroupSent``).

A request whose decode worker already has its Decode call open (``kv_consumer``) is announced
to that worker with ``KVReady`` the moment the prompt is done (``KVAnnouncer``: queued by the
engine thread, sent by a thread of its own), without waiting for this call's event loop.
"""

from __future__ import annotations

import asyncio
import functools
import time

import grpc

from pdserve.engine.engine_loop import EngineStopped
from pdserve.engine.request import KVRole
from pdserve.kvtransfer import SentReporter
from pdserve.rpc.logprobs import token_logprobs
from pdserve.rpc.sampling import sampling_params
from pdserve.v1 import worker_pb2
from pdserve.worker.group.sent import GroupSent
from pdserve.worker.kv_announcer import KVAnnouncer
from pdserve.worker.runtime import WorkerRuntime, WorkerServicer


class PrefillService(WorkerServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        super().__init__(runtime)
        engine_loop = runtime.engine_loop
        on_sent = engine_loop.kv_sent
        group = runtime.group
        self.group_sent: GroupSent | None = None
        if group is not None:  # every rank's notices must be in: its own and the other ranks'
            self.group_sent = GroupSent(group.link.size, engine_loop.kv_sent, forget_after_s=runtime.config.hold_s)
            group.link.on_sent = self.group_sent.rank_sent
            on_sent = functools.partial(self.group_sent.rank_sent, 0)
        self.sent = SentReporter(runtime.agent, on_sent, is_wanted=lambda: engine_loop.load.held_requests > 0)
        cluster = runtime.config.cluster_tls
        self.announcer = KVAnnouncer(
            runtime.worker_id, runtime.config.hold_s, None if cluster is None else cluster.client
        )
        engine_loop.on_produced = self.announcer.produced

    async def start(self) -> None:
        self.sent.start()

    async def close(self) -> None:
        self.sent.close()
        self.announcer.close()

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        await self.runtime.admin.check_caller(context, "Prefill")
        await self.refuse_if_draining(context)
        engine_loop = self.runtime.engine_loop
        request_id = request.request_id
        if request.kv_consumer and not self.announcer.expect(request_id, request.kv_consumer):
            # Another call holds the id: its announcement is left alone, and so is its request.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id {request_id!r} is already in use")
        try:
            params = sampling_params(request.sampling)
            stream = await engine_loop.add(
                request_id,
                list(request.prompt_token_ids),
                params,
                KVRole.PRODUCER,
                pin_s=self.runtime.config.hold_s,
                generated_token_ids=list(request.generated_token_ids),
                cache_salt=request.cache_salt or None,
            )
        except ValueError as exc:
            if request.kv_consumer:  # this call's expectation, never that of the call holding the id
                self.announcer.forget(request_id)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineStopped as exc:  # its worker is failing: another prefill worker may take it
            self.announcer.forget(request_id)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.runtime.worker_id}: {exc}")
        try:
            final = None
            async for output in stream.outputs():
                final = output
        except asyncio.CancelledError:
            engine_loop.abort(request_id)  # frees the blocks, pinned or not
            raise
        finally:
            self.announcer.forget(request_id)  # announced by now, or never to be
        assert final is not None
        if final.finish_reason != "kv_transfer" or final.held_block_ids is None:
            self.runtime.metrics.request_ended(final.finish_reason or "abort")
            # The engine ended it itself: a context that can never fit, or the engine failed.
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED if final.finish_reason == "length" else grpc.StatusCode.UNAVAILABLE,
                f"prefill of {request_id} on {self.runtime.worker_id} ended with {final.finish_reason!r}",
            )
        self.sent.wake()  # a pin waits for notices now (the load read by is_wanted counts it)
        if self.runtime.group is not None:
            self.runtime.group.link.expect_notices(request_id, self.runtime.config.hold_s)
        scheduled = final.first_scheduled_time or final.arrival_time
        first_token = final.first_token_time or time.monotonic()
        metrics = self.runtime.metrics
        metrics.queue_seconds.observe(scheduled - final.arrival_time)
        metrics.prefill_seconds.observe(first_token - scheduled)
        metrics.prompt_admitted(final.num_prompt_tokens, final.num_cached_tokens)
        metrics.request_ended("prefilled")
        response = worker_pb2.PrefillResponse(
            worker_id=self.runtime.worker_id,
            first_token_id=final.token_ids[-1],  # after any it resumed with
            block_ids=final.held_block_ids,
            num_cached_tokens=final.num_cached_tokens,
            queue_ms=(scheduled - final.arrival_time) * 1e3,
            prefill_ms=(first_token - scheduled) * 1e3,
            hold_seconds=self.runtime.config.hold_s,
        )
        if final.new_logprobs and final.new_logprobs[0] is not None:
            response.first_token_logprobs.CopyFrom(token_logprobs(final.new_logprobs[0]))
        return response

    async def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseResponse:
        """A hint, idempotent: free the request's pin if the engine still holds it."""
        await self.runtime.admin.check_caller(context, "Release")
        return worker_pb2.ReleaseResponse(released=await self.runtime.engine_loop.release_pin(request.request_id))
