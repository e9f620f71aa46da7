"""The prefill half of one attempt: the Prefill call on the chosen prefill worker, once more on
another when the first fails, and the ``release`` of what it pinned.

Contract: ``PrefillStep.run`` returns a ``Prefilled`` when a prefill worker computed the prompt
(with the tokens streamed so far) and returned the next token. That worker's engine then holds
the KV's blocks pinned under the attempt's request id until the decode worker's completion
notices free them, their deadline (``hold_seconds``) passes, or ``release`` asks; the caller
calls ``release`` exactly when its decode worker never reported ``DecodeStarted``. ``run``
returns None when conditional disaggregation lets the decode worker compute the prompt (no other
prefill worker is left), and raises ``FlowError`` when the prefill failed for good: then no pin
is the caller's to release.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from pdserve.discovery.registry import Role, WorkerEntry
from pdserve.frontend.attempt import RETRYABLE, FlowError
from pdserve.frontend.channels import WorkerChannels, unavailable_if_closed
from pdserve.frontend.kv_fit import KVMisfit
from pdserve.frontend.router import NoWorker, PrefillChoice
from pdserve.frontend.routing import Routing
from pdserve.rpc.kv_source import ready_source
from pdserve.v1 import worker_pb2

logger = logging.getLogger(__name__)

# A Release the prefill worker has not answered within this long is dropped: the pin's deadline frees it.
_RELEASE_TIMEOUT_S = 5.0


@dataclass
class Prefilled:
    """The prompt's KV, computed on ``worker`` and pinned there under ``request_id`` (the attempt's)."""

    worker: WorkerEntry
    response: worker_pb2.PrefillResponse
    sent_at: float  # when the Prefill call went out
    returned_at: float  # when it came back: the pin's ``hold_seconds`` run from about then
    attempts: int  # ``worker`` was the attempts-th tried
    request_id: str

    def ready_source(self) -> worker_pb2.KVSource:
        """Where the KV is, and how long its pin has left."""
        pr = self.response
        pin_left = pr.hold_seconds - (time.monotonic() - self.returned_at)
        return ready_source(
            self.worker.worker_id, pr.block_ids, pr.first_token_id, pin_left, peer_info=self.worker.nixl
        )


@dataclass
class PrefillStep:
    """The prefill of one attempt of a request for ``model``.

    ``message``: the attempt's ``PrefillRequest`` (its request id, the prompt, the tokens
    streamed so far), sent to each worker tried with only ``kv_consumer`` set for it.
    ``timeout``: what is left of the request's deadline; raises ``FlowError`` once it passed.
    """

    routing: Routing
    model: str
    message: worker_pb2.PrefillRequest
    timeout: Callable[[], float]

    async def run(
        self, choice: PrefillChoice, decode: WorkerEntry, *, avoid: Sequence[str], announce: bool
    ) -> Prefilled | None:
        """Prefill on ``choice``, then once more elsewhere (never on ``avoid``); None: fall back to
        the decode worker. ``announce``: the first worker tells ``decode`` itself when the KV is ready."""
        router, view = self.routing.router, self.routing.view
        failures: list[str] = []
        current: PrefillChoice | None = choice
        for tries in (1, 2):
            if current is None:
                break
            try:
                return await self._on(current, tries, decode.endpoint if announce and tries == 1 else "")
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE:
                    raise FlowError(exc.code(), exc.details() or str(exc.code())) from None
                failures.append(f"{current.worker.worker_id}: {exc.code().name} {exc.details()}")
                logger.warning("prefill of %s failed on %s", self.message.request_id, failures[-1])
            if tries == 1:
                try:
                    current = router.choose_prefill(
                        view.workers(Role.PREFILL, self.model),
                        self._token_ids(),
                        exclude=[*avoid, choice.worker.worker_id],
                        knobs=view.knobs(self.model),
                        decode=decode,
                        cache_salt=self.message.cache_salt or None,
                    )
                except (NoWorker, KVMisfit):
                    current = None
                if current is None and router.config.disaggregation == "conditional":
                    return None  # no other prefill worker: compute the prompt on the decode worker
        raise FlowError(grpc.StatusCode.UNAVAILABLE, f"prefill failed: {'; '.join(failures) or 'no other worker'}")

    def _token_ids(self) -> list[int]:
        """The prompt and the tokens streamed so far: what the KV is built from."""
        return [*self.message.prompt_token_ids, *self.message.generated_token_ids]

    async def _on(self, choice: PrefillChoice, tries: int, kv_consumer: str) -> Prefilled:
        router = self.routing.router
        num_tokens = len(self._token_ids())
        stub = self.routing.channels.stub(choice.worker.endpoint)
        message = worker_pb2.PrefillRequest()
        message.CopyFrom(self.message)
        message.kv_consumer = kv_consumer
        sent_at = time.monotonic()
        router.prefill_started(choice, num_tokens)
        try:
            with unavailable_if_closed(choice.worker.endpoint):
                response = await stub.Prefill(message, timeout=self.timeout())
        finally:
            router.prefill_done(choice, num_tokens)
        return Prefilled(choice.worker, response, sent_at, time.monotonic(), tries, message.request_id)


def release(channels: WorkerChannels, prefilled: Prefilled) -> None:
    """Unpin the prompt's blocks on the prefill worker, in the background, best effort."""
    stub = channels.stub(prefilled.worker.endpoint)

    async def send() -> None:
        try:
            await stub.Release(worker_pb2.ReleaseRequest(request_id=prefilled.request_id), timeout=_RELEASE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            logger.info("release of %s on %s: %s", prefilled.request_id, prefilled.worker.worker_id, exc.code().name)

    channels.in_background(send())
