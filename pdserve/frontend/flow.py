"""One request's way through the workers, as the stream of messages its client receives.

    route ─▶ Prefill on a prefill worker ──first token──▶ client
              (fails before the first token: once more on another worker)
          ─▶ Decode on the decode worker, told where the KV is ──tokens──▶ client

The Decode call opens together with the Prefill call, its ``kv_source`` ``pending``: the decode
worker sets the call up and loads the prefill worker as a peer while the prompt computes, and
the prefill worker tells it (``KVReady``) the moment the KV is ready, so the pull starts
then. If the decode worker has not reported the pull ``_KV_READY_BACKUP_S`` after the
Prefill call returned, the frontend sends the same ``KVReady``: the first may have been lost
(sent at once, it would land in the middle of most pulls and slow them). When the prefill
fails over to a second worker, the call is cancelled and a new one made with the KV's place
known.

Without a prefill worker (conditional disaggregation said so, or ``off``) the decode worker
computes the prompt itself. Every call carries what is left of the request's deadline.

A decode worker's stream that breaks before the request ends (the worker died, its call
failed, its pull failed) migrates the request: the flow routes it again, excluding the
workers that failed it and their data-parallel groups (``groups``), with the prompt plus
every token already streamed (``generated_token_ids``), so the KV is rebuilt there or on a
prefill worker, and the next token continues the client's one stream; the engine counts
those tokens for ``max_tokens`` and the penalties and skips a seeded request's draws for them,
so the tokens are those an unbroken stream would have had. At most ``Routing.max_migrations`` times, within the
deadline; then UNAVAILABLE naming every worker tried. Each attempt has its own request id
(``ID``, then ``ID.m1``...), so a late ``Release`` or an old pin never meets a new one; what
belongs to one attempt lives in its ``Attempt``, made fresh for each.
A decode worker that refuses because it could not pull the KV (``KV_SOURCE_FAILED``: the
prefill worker died or stalled) is not at fault: the next attempt avoids that prefill worker
instead, and may decode on the same decode worker.

The prefill worker's engine owns the pinned blocks: the decode worker's completion notices
free them, or their deadline. The frontend keeps no state about them, and has one rule: when
a flow that prefilled ends before the decode worker reported the pull done (its
``DecodeStarted``, sent right after the pull), the frontend sends ``Release`` to the prefill
worker in the background (best effort, bounded; ``prefill_step.release``). That covers a flow
that failed or was cancelled, and a decode worker that ended the request before it pulled.
``Release`` is an idempotent hint: sent after the notices freed the blocks, it does no harm.

Workers send token ids; the request's ``TextStream`` makes the text and applies the stop
strings. When a stop string ends the request, the flow ends the decode call (cancelling it
aborts the request on the worker and frees its blocks) and sends the final message itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator

import grpc

from pdserve.discovery.registry import Role, WorkerEntry
from pdserve.frontend.attempt import RETRYABLE, Attempt, Broken, FlowError
from pdserve.frontend.catalog import ValidRequest
from pdserve.frontend.channels import LeftRegistry, unavailable_if_closed
from pdserve.frontend.flow_report import FlowReport
from pdserve.frontend.kv_fit import KVMisfit
from pdserve.frontend.prefill_step import Prefilled, PrefillStep, release
from pdserve.frontend.router import NoWorker, PrefillChoice
from pdserve.frontend.routing import Routing
from pdserve.frontend.text_stream import TextStream
from pdserve.rpc.status import DRAINING, KV_SOURCE_FAILED, refusal_reason
from pdserve.v1 import inference_pb2, worker_pb2

logger = logging.getLogger(__name__)

# A KVReady the decode worker has not answered within this long is not waited for.
_KV_READY_TIMEOUT_S = 5.0
# The frontend's own KVReady goes this long after the Prefill call returned, unless the pull was done.
_KV_READY_BACKUP_S = 0.5
# A migrating request with no decode worker to go to looks again this often, until its deadline.
_WORKER_WAIT_S = 0.2


class RequestFlow:
    def __init__(
        self, routing: Routing, request: ValidRequest, request_id: str, arrival: float, deadline: float
    ) -> None:
        self.routing = routing
        self.request = request
        self.request_id = request_id
        self.arrival = arrival
        self.deadline = deadline
        self.report = FlowReport(arrival)
        self.output = TextStream(request.tokenizer, request.token_ids, request.params.stop)
        self._failed: list[str] = []  # decode workers whose stream broke, in order
        self._left: list[str] = []  # decode workers whose stream was cut as they left the registry
        self._lost_sources: list[str] = []  # prefill workers whose KV could not be pulled, in order

    @property
    def num_tokens(self) -> int:
        """Tokens streamed to the client so far."""
        return self.output.num_tokens

    def _timeout(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise FlowError(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {self.request_id} passed its deadline")
        return remaining

    @property
    def num_migrations(self) -> int:
        """Times the request moved to another decode worker so far."""
        return self.report.breakdown.migrations

    async def run(self) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        attempt = Attempt(self.request_id)
        while True:
            try:
                async with contextlib.aclosing(self._attempt(attempt)) as messages:
                    async for message in messages:
                        yield message
                return
            except Broken as broken:
                if broken.kv_source:  # the next attempt avoids the prefill worker, not the decode worker
                    self._lost_sources.append(broken.kv_source)
                elif broken.left_registry:  # avoided while it is away, as every unregistered worker is
                    self._left.append(broken.worker_id)
                else:
                    self._failed.append(broken.worker_id)
                logger.warning("decode of %s broke on %s after %d tokens", self.request_id, broken, self.num_tokens)
                if self.num_tokens >= self.request.params.max_tokens:  # only the final message was lost
                    yield self._final(inference_pb2.GenerateResponse(), "length")
                    return
                if attempt.number >= self.routing.max_migrations:
                    raise FlowError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"{self._tried()} (last: {broken.reason}); "
                        f"gave up after {self.routing.max_migrations} migrations (max_migrations)",
                    ) from None
                attempt = Attempt.after(attempt, broken, self.request_id, self.num_tokens)

    async def _attempt(self, attempt: Attempt) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        """One try at the request, on workers that have not failed it, from the tokens streamed so far."""
        model = self.request.model.name
        view, router = self.routing.view, self.routing.router
        try:
            decode = await self._choose_decode()
            choice = router.choose_prefill(
                view.workers(Role.PREFILL, model),
                self._known_token_ids(),
                exclude=self._lost_sources,
                knobs=view.knobs(model),
                decode=decode,
                cache_salt=self.request.cache_salt,
            )
        except KVMisfit as exc:  # a deployment that cannot work: said at once, never at transfer time
            raise FlowError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        except NoWorker as exc:
            tried = f" ({self._tried()})" if self._failed or self._left or self._lost_sources else ""
            raise FlowError(
                grpc.StatusCode.UNAVAILABLE, f"no {exc} worker is available for model {model!r}{tried}"
            ) from None
        # Counted against its decode worker from the choice on, not from the decode call: requests
        # arriving together during their prefills spread over the decode workers.
        attempt.decode_worker = decode
        router.decode_started(decode)
        try:
            async with contextlib.aclosing(self._prefill_then_decode(attempt, decode, choice)) as messages:
                async for message in messages:
                    yield message
        finally:
            router.decode_done(attempt.decode_worker)

    async def _prefill_then_decode(
        self, attempt: Attempt, decode: WorkerEntry, choice: PrefillChoice | None
    ) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        early = self._open_decode(attempt, decode, choice) if choice is not None else None
        backup: asyncio.Task[None] | None = None
        prefilled: Prefilled | None = None
        try:
            if choice is not None:
                step = self._prefill(attempt)
                prefilled = await step.run(choice, decode, avoid=self._lost_sources, announce=early is not None)
        except BaseException:
            if early is not None:
                early.cancel()
            raise
        if prefilled is not None and attempt.is_first:
            self.report.prefilled(prefilled.response, prefilled.attempts, prefilled.sent_at)
        if early is not None and (prefilled is None or prefilled.attempts > 1):
            early.cancel()  # the KV is on another prefill worker, or nowhere: a new call says so
            early = None
        if attempt.migration is not None:
            attempt.migration.prefill_worker = prefilled.worker.worker_id if prefilled is not None else ""
        try:  # the prefill worker holds the blocks from here: a client gone after the first token releases them too
            if prefilled is not None:
                if early is not None:
                    backup = self._announce_later(attempt, decode, prefilled)
                self.report.first_token()
                self.report.streamed(1)
                pr = prefilled.response
                first_logprobs = [pr.first_token_logprobs] if pr.HasField("first_token_logprobs") else []
                first = self.output.add([pr.first_token_id], first_logprobs)
                if self.output.stopped:  # the first token's text holds a stop string: no decode
                    yield self._final(first, "stop")
                    return
                yield first
            async with contextlib.aclosing(self._decode(attempt, decode, prefilled, early)) as messages:
                async for message in messages:
                    yield message
        finally:
            if early is not None:
                early.cancel()  # a no-op unless no decode used it (a stop string in the first token, a client gone)
            if backup is not None:
                backup.cancel()  # the request is over: nobody waits for the KV any more
            if prefilled is not None and not attempt.decode_started:
                release(self.routing.channels, prefilled)  # no pull reported: unpin at once, not at the deadline

    async def _choose_decode(self) -> WorkerEntry:
        """This attempt's decode worker. A migrating request with none to go to waits for one
        (the only other may be restarting, and comes back under a new id, or registering again
        after the registry lost it) for ``Routing.migration_wait_s`` (then NoWorker) within its
        deadline (then DEADLINE_EXCEEDED)."""
        model, router, view = self.request.model.name, self.routing.router, self.routing.view
        give_up = time.monotonic() + self.routing.migration_wait_s
        while True:
            try:
                return router.choose_decode(view.workers(Role.DECODE, model), exclude=self._failed)
            except NoWorker:
                if not (self._failed or self._left) or time.monotonic() + _WORKER_WAIT_S > give_up:
                    raise
                if time.monotonic() + _WORKER_WAIT_S >= self.deadline:
                    raise FlowError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"request {self.request_id} passed its deadline waiting for a decode worker of model "
                        f"{model!r} ({self._tried()})",
                    ) from None
            await asyncio.sleep(_WORKER_WAIT_S)

    def _tried(self) -> str:
        """The workers that failed this request, for its error message."""
        parts = [f"decode failed on {', '.join(self._failed)}"] if self._failed else []
        if self._left:
            parts.append(f"decode cut as {', '.join(self._left)} left the registry")
        if self._lost_sources:
            parts.append(f"KV could not be pulled from {', '.join(self._lost_sources)}")
        return "; ".join(parts)

    def _known_token_ids(self) -> list[int]:
        """The prompt and the tokens streamed so far: what a migrated attempt's KV is built from."""
        return [*self.request.token_ids, *self.output.token_ids]

    def _prefill(self, attempt: Attempt) -> PrefillStep:
        """The attempt's prefill, from the prompt and the tokens streamed so far."""
        message = worker_pb2.PrefillRequest(
            request_id=attempt.request_id,
            prompt_token_ids=self.request.token_ids,
            sampling=self._sampling(),
            generated_token_ids=self.output.token_ids,
            cache_salt=self.request.cache_salt or "",
        )
        return PrefillStep(self.routing, self.request.model.name, message, self._timeout)

    # ---- decode --------------------------------------------------------------------------------------
    def _open_decode(self, attempt: Attempt, decode: WorkerEntry, choice: PrefillChoice) -> grpc.aio.UnaryStreamCall:
        """The Decode call opened beside the Prefill call on ``choice``: its kv_source pending."""
        source = worker_pb2.KVSource(worker_id=choice.worker.worker_id, peer_info=choice.worker.nixl, pending=True)
        message = worker_pb2.DecodeRequest(
            request_id=attempt.request_id,
            prompt_token_ids=self.request.token_ids,
            sampling=self._sampling(),
            generated_token_ids=self.output.token_ids,
            kv_source=source,
            cache_salt=self.request.cache_salt or "",
        )
        return self.routing.channels.stub(decode.endpoint).Decode(message, timeout=self._timeout())

    def _announce_later(self, attempt: Attempt, decode: WorkerEntry, prefilled: Prefilled) -> asyncio.Task[None]:
        """Tell the open Decode call its KV is ready unless it reported the pull done within
        ``_KV_READY_BACKUP_S`` (the prefill worker's KVReady was lost), in the background."""
        stub = self.routing.channels.stub(decode.endpoint)

        async def announce() -> None:
            await asyncio.sleep(_KV_READY_BACKUP_S)
            if attempt.decode_started:
                return
            message = worker_pb2.KVReadyRequest(request_id=prefilled.request_id, kv_source=prefilled.ready_source())
            try:
                await stub.KVReady(message, timeout=_KV_READY_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:  # the Decode call fails too, and says why
                logger.info("KVReady of %s on %s: %s", prefilled.request_id, decode.worker_id, exc.code().name)

        return self.routing.channels.in_background(announce())

    async def _decode(
        self, attempt: Attempt, decode: WorkerEntry, prefilled: Prefilled | None, early: grpc.aio.UnaryStreamCall | None
    ) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        """Stream the decode, on ``early`` (the call opened beside the prefill) when there is one."""
        message = worker_pb2.DecodeRequest(
            request_id=attempt.request_id,
            prompt_token_ids=self.request.token_ids,
            sampling=self._sampling(),
            # The prefill worker's token (the last one streamed) comes in kv_source.
            generated_token_ids=self.output.token_ids if prefilled is None else self.output.token_ids[:-1],
            cache_salt=self.request.cache_salt or "",
        )
        if prefilled is not None:
            message.kv_source.CopyFrom(prefilled.ready_source())
        refused: list[str] = []
        call = early
        while True:
            self._migrated_to(attempt, decode)
            try:
                async with contextlib.aclosing(self._decode_on(attempt, decode, message, call)) as responses:
                    async for response in responses:
                        yield response
                return
            except grpc.aio.AioRpcError as exc:
                call = None  # any second call carries the whole kv_source
                reason = refusal_reason(exc)
                if reason == KV_SOURCE_FAILED and prefilled is not None:
                    raise Broken(decode.worker_id, exc.details(), kv_source=prefilled.worker.worker_id) from None
                # A draining worker refused it before starting anything: another may take it as it is.
                if reason == DRAINING and not refused:
                    refused.append(decode.worker_id)
                    router = self.routing.router
                    try:
                        decode = router.choose_decode(
                            self.routing.view.workers(Role.DECODE, self.request.model.name),
                            exclude=[*self._failed, *refused],
                        )
                        assert attempt.decode_worker is not None  # set by _attempt before any decode
                        router.decode_done(attempt.decode_worker)
                        router.decode_started(decode)
                        attempt.decode_worker = decode
                        continue
                    except NoWorker:
                        pass
                if exc.code() in RETRYABLE:  # the worker or its call broke: the request may migrate
                    left = isinstance(exc, LeftRegistry)
                    raise Broken(decode.worker_id, f"{exc.code().name} {exc.details()}", left_registry=left) from None
                raise FlowError(exc.code(), f"decode on {decode.worker_id} failed: {exc.details()}") from None

    def _migrated_to(self, attempt: Attempt, decode: WorkerEntry) -> None:
        """Record the attempt's decode worker in its migration (the first time it is known)."""
        if attempt.migration is None:
            return
        attempt.migration.to_worker = decode.worker_id
        if not attempt.migration.prefill_worker:
            attempt.migration.prefill_worker = decode.worker_id
        self.report.migrated(attempt.migration)
        attempt.migration = None  # recorded once; a refusal's second worker is not a second migration

    async def _decode_on(
        self,
        attempt: Attempt,
        decode: WorkerEntry,
        message: worker_pb2.DecodeRequest,
        call: grpc.aio.UnaryStreamCall | None,
    ) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        sent_at = time.monotonic()
        if call is None:
            call = self.routing.channels.stub(decode.endpoint).Decode(message, timeout=self._timeout())
        try:
            with unavailable_if_closed(decode.endpoint):
                async for response in call:
                    if response.HasField("started"):
                        self._started(attempt, response.started, sent_at)
                    out = self.output.add(response.token_ids, response.logprobs)
                    if out.token_ids:
                        self.report.streamed(len(out.token_ids))
                    if response.HasField("final") or self.output.stopped:
                        reason = response.final.finish_reason if response.HasField("final") else "stop"
                        yield self._final(out, reason, decode)
                        # A call still streaming (a stop string ended it) is cancelled below: its worker aborts it.
                        return
                    if not response.token_ids:
                        continue  # only news of the start
                    if out.token_ids:  # the first token, when the prompt was computed here
                        self.report.first_token()
                    yield out
            raise Broken(decode.worker_id, "the stream ended without a final message")
        finally:
            call.cancel()

    def _started(self, attempt: Attempt, started: worker_pb2.DecodeStarted, sent_at: float) -> None:
        """The decode worker began the request: after the pull, or with a prompt computed there."""
        attempt.decode_started = True
        if attempt.is_first:
            self.report.decode_started(started, sent_at)

    def _final(
        self, message: inference_pb2.GenerateResponse, finish_reason: str, decode: WorkerEntry | None = None
    ) -> inference_pb2.GenerateResponse:
        """``message`` made the last one: the usage and the latency breakdown go with it."""
        self.output.finish(message, finish_reason)
        self.report.finish(message, decode.worker_id if decode is not None else "", len(self.request.token_ids))
        return message

    def _sampling(self) -> inference_pb2.SamplingOptions:
        return self.request.options
