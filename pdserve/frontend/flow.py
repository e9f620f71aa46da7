"""One request's way through the workers, as the stream of messages its client receives.

    route ─▶ Prefill on a prefill worker ──first token──▶ client
              (fails before the first token: once more on another worker)
          ─▶ Decode on the decode worker, told where the KV is ──tokens──▶ client

Without a prefill worker (conditional disaggregation said so, or ``off``) the decode worker
computes the prompt itself. Every call carries what is left of the request's deadline.

The prefill worker's engine owns the pinned blocks: the decode worker's completion notices
free them, or their deadline. The frontend keeps no state about them, and has one rule: when
a flow that prefilled ends before the decode worker reported the pull done (its
``DecodeStarted``, sent right after the pull), the frontend sends ``Release`` to the prefill
worker in the background (best effort, bounded). That covers a flow that failed or was
cancelled, and a decode worker that ended the request before it pulled. ``Release`` is an
idempotent hint: sent after the notices freed the blocks, it does no harm.

Workers send token ids; the request's ``TextStream`` makes the text and applies the stop
strings. When a stop string ends the request, the flow ends the decode call (cancelling it
aborts the request on the worker and frees its blocks) and sends the final message itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from pdserve.discovery.registry import Role, WorkerEntry
from pdserve.discovery.registry_view import RegistryView
from pdserve.frontend.catalog import ValidRequest
from pdserve.frontend.channels import WorkerChannels
from pdserve.frontend.router import NoWorker, PrefillChoice, Router
from pdserve.frontend.text_stream import TextStream
from pdserve.rpc.status import DRAINING, refusal_reason
from pdserve.v1 import inference_pb2, worker_pb2

logger = logging.getLogger(__name__)

# Prefill failures worth a second worker; others (a bad request, the deadline) are final.
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
}  # fmt: skip
# The decode worker must finish pulling this long before the prefill worker's pin runs out.
_PIN_MARGIN_S = 2.0


class FlowError(Exception):
    """The request failed; ``code`` and ``message`` go to the client."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Routing:
    """What the frontend shares with every request: registry view, router, channels."""

    view: RegistryView
    router: Router
    channels: WorkerChannels


@dataclass
class _Prefilled:
    worker: WorkerEntry
    response: worker_pb2.PrefillResponse
    sent_at: float
    attempts: int


class RequestFlow:
    def __init__(
        self, routing: Routing, request: ValidRequest, request_id: str, arrival: float, deadline: float
    ) -> None:
        self.routing = routing
        self.request = request
        self.request_id = request_id
        self.arrival = arrival
        self.deadline = deadline
        self.breakdown = inference_pb2.LatencyBreakdown()
        self.output = TextStream(request.tokenizer, request.token_ids, request.params.stop)
        self._token_times: list[tuple[float, int]] = []  # (when, how many tokens) per message
        self._cached_tokens = 0  # prompt tokens the prompt's worker found in its prefix cache
        self._decode_started = False  # the decode worker reported the start (after the pull, if any)

    @property
    def num_tokens(self) -> int:
        """Tokens streamed to the client so far."""
        return self.output.num_tokens

    def _timeout(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise FlowError(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {self.request_id} passed its deadline")
        return remaining

    async def run(self) -> AsyncIterator[inference_pb2.GenerateResponse]:
        model = self.request.model.name
        view, router = self.routing.view, self.routing.router
        try:
            decode = router.choose_decode(view.workers(Role.DECODE, model))
            choice = router.choose_prefill(view.workers(Role.PREFILL, model), self.request.token_ids,
                                           knobs=view.knobs(model))  # fmt: skip
        except NoWorker as exc:
            raise FlowError(grpc.StatusCode.UNAVAILABLE, f"no {exc} worker is available for model {model!r}") from None
        prefilled = await self._prefill(choice) if choice is not None else None
        try:  # the prefill worker holds the blocks from here: a client gone after the first token releases them too
            if prefilled is not None:
                self.breakdown.ttft_ms = (time.monotonic() - self.arrival) * 1e3
                self._token_times.append((time.monotonic(), 1))
                pr = prefilled.response
                first_logprobs = [pr.first_token_logprobs] if pr.HasField("first_token_logprobs") else []
                first = self.output.add([pr.first_token_id], first_logprobs)
                if self.output.stopped:  # the first token's text holds a stop string: no decode
                    yield self._final(first, "stop")
                    return
                yield first
            async for message in self._decode(decode, prefilled):
                yield message
        finally:
            if prefilled is not None and not self._decode_started:
                self._release(prefilled)  # no pull reported: unpin at once, not at the deadline

    # ---- prefill -----------------------------------------------------------------------------------
    async def _prefill(self, choice: PrefillChoice) -> _Prefilled | None:
        """Prefill on ``choice``, then once more elsewhere; None: fall back to the decode worker."""
        router, view = self.routing.router, self.routing.view
        failures: list[str] = []
        current: PrefillChoice | None = choice
        for attempt in (1, 2):
            if current is None:
                break
            try:
                return await self._prefill_on(current, attempt)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise FlowError(exc.code(), exc.details() or str(exc.code())) from None
                failures.append(f"{current.worker.worker_id}: {exc.code().name} {exc.details()}")
                logger.warning("prefill of %s failed on %s", self.request_id, failures[-1])
            if attempt == 1:
                try:
                    others = view.workers(Role.PREFILL, self.request.model.name)
                    current = router.choose_prefill(others, self.request.token_ids, exclude=[choice.worker.worker_id],
                                                    knobs=view.knobs(self.request.model.name))  # fmt: skip
                except NoWorker:
                    current = None
                if current is None and router.config.disaggregation == "conditional":
                    return None  # no other prefill worker: compute the prompt on the decode worker
        raise FlowError(grpc.StatusCode.UNAVAILABLE, f"prefill failed: {'; '.join(failures) or 'no other worker'}")

    async def _prefill_on(self, choice: PrefillChoice, attempt: int) -> _Prefilled:
        router = self.routing.router
        num_tokens = len(self.request.token_ids)
        stub = self.routing.channels.stub(choice.worker.endpoint)
        message = worker_pb2.PrefillRequest(
            request_id=self.request_id, prompt_token_ids=self.request.token_ids, sampling=self._sampling()
        )
        sent_at = time.monotonic()
        router.prefill_started(choice, num_tokens)
        try:
            response = await stub.Prefill(message, timeout=self._timeout())
        finally:
            router.prefill_done(choice, num_tokens)
        b = self.breakdown
        b.disaggregated = True
        b.prefill_worker = response.worker_id
        b.prefill_attempts = attempt
        b.queue_ms = (sent_at - self.arrival) * 1e3 + response.queue_ms
        b.prefill_ms = response.prefill_ms
        self._cached_tokens = response.num_cached_tokens
        return _Prefilled(choice.worker, response, time.monotonic(), attempt)

    def _release(self, prefilled: _Prefilled) -> None:
        """Unpin the prompt's blocks on the prefill worker, in the background, best effort."""
        stub = self.routing.channels.stub(prefilled.worker.endpoint)

        async def release() -> None:
            try:
                await stub.Release(worker_pb2.ReleaseRequest(request_id=self.request_id), timeout=5.0)
            except grpc.aio.AioRpcError as exc:
                logger.info("release of %s on %s: %s", self.request_id, prefilled.worker.worker_id, exc.code().name)

        self.routing.channels.in_background(release())

    # ---- decode --------------------------------------------------------------------------------------
    async def _decode(
        self, decode: WorkerEntry, prefilled: _Prefilled | None
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        message = worker_pb2.DecodeRequest(
            request_id=self.request_id, prompt_token_ids=self.request.token_ids, sampling=self._sampling()
        )
        if prefilled is not None:
            pr = prefilled.response
            pin_left = pr.hold_seconds - (time.monotonic() - prefilled.sent_at) - _PIN_MARGIN_S
            message.kv_source.CopyFrom(
                worker_pb2.KVSource(
                    worker_id=pr.worker_id,
                    peer_info=prefilled.worker.nixl,
                    block_ids=pr.block_ids,
                    first_token_id=pr.first_token_id,
                    pull_within_s=max(pin_left, 0.0),
                )  # fmt: skip
            )
        tried: list[str] = []
        while True:
            tried.append(decode.worker_id)
            received = False
            try:
                async for response in self._decode_on(decode, message, prefilled):
                    received = True
                    yield response
                return
            except grpc.aio.AioRpcError as exc:
                # Another worker may take it only if this one never started it.
                refused = refusal_reason(exc) == DRAINING
                local_and_unstarted = prefilled is None and exc.code() == grpc.StatusCode.UNAVAILABLE
                if received or len(tried) > 1 or not (refused or local_and_unstarted):
                    raise FlowError(
                        grpc.StatusCode.UNAVAILABLE if exc.code() in _RETRYABLE else exc.code(),
                        f"decode on {decode.worker_id} failed: {exc.details()}",
                    ) from None
                try:
                    decode = self.routing.router.choose_decode(
                        self.routing.view.workers(Role.DECODE, self.request.model.name), exclude=tried
                    )
                except NoWorker:
                    raise FlowError(
                        grpc.StatusCode.UNAVAILABLE, f"decode on {decode.worker_id} failed: {exc.details()}"
                    ) from None

    async def _decode_on(
        self, decode: WorkerEntry, message: worker_pb2.DecodeRequest, prefilled: _Prefilled | None
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        router = self.routing.router
        sent_at = time.monotonic()
        call = self.routing.channels.stub(decode.endpoint).Decode(message, timeout=self._timeout())
        router.decode_started(decode)
        try:
            async for response in call:
                if response.HasField("started"):
                    self._started(response.started, sent_at)
                out = self.output.add(response.token_ids, response.logprobs)
                if out.token_ids:
                    self._token_times.append((time.monotonic(), len(out.token_ids)))
                if response.HasField("final") or self.output.stopped:
                    reason = response.final.finish_reason if response.HasField("final") else "stop"
                    yield self._final(out, reason, decode)
                    return  # a call still streaming (a stop string ended it) is cancelled below: its worker aborts it
                if not response.token_ids:
                    continue  # only news of the start
                if prefilled is None and not self.breakdown.ttft_ms and out.token_ids:
                    self.breakdown.ttft_ms = (time.monotonic() - self.arrival) * 1e3
                yield out
            raise FlowError(grpc.StatusCode.UNAVAILABLE, f"decode on {decode.worker_id} ended without a final message")
        finally:
            call.cancel()
            router.decode_done(decode)

    def _started(self, started: worker_pb2.DecodeStarted, sent_at: float) -> None:
        """The decode worker began the request: after the pull, or with a prompt computed there."""
        self._decode_started = True
        b = self.breakdown
        b.kv_transfer_ms = started.kv_transfer_ms
        b.kv_transfer_bytes = started.kv_transfer_bytes
        if not b.disaggregated:
            b.queue_ms = (sent_at - self.arrival) * 1e3 + started.queue_ms
            b.prefill_ms = started.prefill_ms
            self._cached_tokens = started.num_cached_tokens

    def _final(
        self, message: inference_pb2.GenerateResponse, finish_reason: str, decode: WorkerEntry | None = None
    ) -> inference_pb2.GenerateResponse:
        """``message`` made the last one: the usage and the latency breakdown go with it."""
        b = self.breakdown
        if decode is not None:
            b.decode_worker = decode.worker_id
            if not b.disaggregated:
                b.prefill_worker = decode.worker_id
        b.e2e_ms = (time.monotonic() - self.arrival) * 1e3
        if not b.ttft_ms:
            b.ttft_ms = b.e2e_ms
        self.output.finish(message, finish_reason)
        message.final.usage.prompt_tokens = len(self.request.token_ids)
        message.final.usage.cached_prompt_tokens = self._cached_tokens
        message.final.breakdown.CopyFrom(b)
        return message

    def token_gaps(self) -> list[float]:
        """Inter-token latencies in seconds: a message of n tokens after a gap counts n gaps of gap/n."""
        gaps: list[float] = []
        for (before, _), (at, count) in zip(self._token_times, self._token_times[1:]):
            gaps += [(at - before) / count] * count
        return gaps

    def _sampling(self) -> inference_pb2.SamplingOptions:
        return self.request.options
