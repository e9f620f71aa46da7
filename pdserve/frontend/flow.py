"""One request's way through the workers, as the stream of messages its client receives.

    route ─▶ Prefill on a prefill worker ──first token──▶ client
              (fails before the first token: once more on another worker)
          ─▶ Decode on the decode worker, told where the KV is ──tokens──▶ client

Without a prefill worker (conditional disaggregation said so, or ``off``) the decode worker
computes the prompt itself. Every call carries what is left of the request's deadline. If the
request ends for any reason before a decode worker has pulled the KV, the prefill worker is
told to release it, so no block stays pinned longer than needed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from pdserve.discovery.registry import Role, WorkerEntry
from pdserve.discovery.registry_view import RegistryView
from pdserve.frontend.catalog import ValidRequest
from pdserve.frontend.channels import WorkerChannels
from pdserve.frontend.router import NoWorker, PrefillChoice, Router
from pdserve.rpc.status import DRAINING
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
    released: bool = field(default=False)


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
        self.num_tokens = 0  # streamed to the client so far
        self._token_times: list[tuple[float, int]] = []  # (when, how many tokens) per message

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
        if prefilled is not None:
            response = prefilled.response
            self.breakdown.ttft_ms = (time.monotonic() - self.arrival) * 1e3
            self.num_tokens = 1
            self._token_times.append((time.monotonic(), 1))
            yield inference_pb2.GenerateResponse(token_ids=[response.first_token_id], text=response.text)
        try:
            async for message in self._decode(decode, prefilled):
                yield message
        finally:
            if prefilled is not None and not prefilled.released:
                self._release(prefilled)

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
        return _Prefilled(choice.worker, response, time.monotonic(), attempt)

    def _release(self, prefilled: _Prefilled) -> None:
        """Unpin the prompt's blocks on the prefill worker, in the background, best effort."""
        prefilled.released = True
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
                refused = exc.code() == grpc.StatusCode.UNAVAILABLE and (exc.details() or "").startswith(DRAINING)
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
                if response.token_ids:
                    self._token_times.append((time.monotonic(), len(response.token_ids)))
                if response.HasField("final"):
                    if prefilled is not None:
                        prefilled.released = True  # the decode worker's notice released it
                    yield self._final(decode, response, sent_at, prefilled)
                    return
                if prefilled is None and not self.breakdown.ttft_ms and response.token_ids:
                    self.breakdown.ttft_ms = (time.monotonic() - self.arrival) * 1e3
                self.num_tokens += len(response.token_ids)
                yield inference_pb2.GenerateResponse(token_ids=response.token_ids, text=response.text)
            raise FlowError(grpc.StatusCode.UNAVAILABLE, f"decode on {decode.worker_id} ended without a final message")
        finally:
            call.cancel()
            router.decode_done(decode)

    def _final(
        self, decode: WorkerEntry, response: worker_pb2.DecodeResponse, sent_at: float, prefilled: _Prefilled | None
    ) -> inference_pb2.GenerateResponse:
        final = response.final
        b = self.breakdown
        b.decode_worker = decode.worker_id
        b.kv_transfer_ms = final.kv_transfer_ms
        b.kv_transfer_bytes = final.kv_transfer_bytes
        if not b.disaggregated:
            b.prefill_worker = decode.worker_id
            b.queue_ms = (sent_at - self.arrival) * 1e3 + final.queue_ms
            b.prefill_ms = final.prefill_ms
        now = time.monotonic()
        b.e2e_ms = (now - self.arrival) * 1e3
        if not b.ttft_ms:
            b.ttft_ms = b.e2e_ms
        cached = final.num_cached_tokens
        if b.disaggregated and prefilled is not None:
            cached = prefilled.response.num_cached_tokens
        return inference_pb2.GenerateResponse(
            token_ids=response.token_ids,
            text=response.text,
            final=inference_pb2.Final(
                finish_reason=final.finish_reason,
                text=final.text,
                usage=inference_pb2.Usage(
                    prompt_tokens=len(self.request.token_ids),
                    completion_tokens=self.num_tokens + len(response.token_ids),
                    cached_prompt_tokens=cached,
                ),
                breakdown=b,
            ),
        )

    def token_gaps(self) -> list[float]:
        """Inter-token latencies in seconds: a message of n tokens after a gap counts n gaps of gap/n."""
        gaps: list[float] = []
        for (before, _), (at, count) in zip(self._token_times, self._token_times[1:]):
            gaps += [(at - before) / count] * count
        return gaps

    def _sampling(self) -> inference_pb2.SamplingOptions:
        return self.request.options
