"""One try at a request, and the two ways a try ends short of the request's end.

Contract: an ``Attempt`` is made fresh for every try (the first, then one per migration) and
dropped when the try ends, so nothing in it is ever reset or seen by the next try. What
outlives a try — the tokens streamed, the workers that failed the request, the latency
report — is the flow's. A try that ends short raises ``Broken`` (the decode worker's stream
broke; the request may go on elsewhere) or ``FlowError`` (the request fails; its code and
message go to the client).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from pdserve.discovery.registry import WorkerEntry
from pdserve.v1 import inference_pb2

# Worker failures worth another try (a second prefill worker, another decode worker); others
# (a bad request, the deadline) are final.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
}


class FlowError(Exception):
    """The request failed; ``code`` and ``message`` go to the client."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Broken(Exception):
    """A decode worker's stream broke before the request ended: it may go on elsewhere.

    ``kv_source``: the prefill worker whose KV the decode worker could not pull. Then the decode
    worker is fine and may take the request again; that prefill worker is the one to avoid.
    ``left_registry``: the stream was cut because its worker left the registry, not because it
    failed: once registered again (the same id), it may take the request again.
    """

    def __init__(self, worker_id: str, reason: str, kv_source: str = "", left_registry: bool = False) -> None:
        super().__init__(f"{worker_id}: {reason}")
        self.worker_id = worker_id
        self.reason = reason
        self.kv_source = kv_source
        self.left_registry = left_registry


@dataclass
class Attempt:
    """One try at a request: its id on the workers, how it came to be, and its decode worker.

    ``request_id``: what the workers see, the request's own id on the first try, then
    ``ID.m1``, ``ID.m2``..., so a late ``Release`` or an old pin never meets a new try.
    ``migration``: why this try exists, when it is a migration; handed to the report once its
    decode worker is known, then None (a refusal's second worker is not a second migration).
    ``decode_worker``: counted in the router's load from its choice to the try's end.
    ``decode_started``: its decode worker reported the start (after the pull, if any); a try
    that prefilled and ends without it releases the prefill worker's pin.
    """

    request_id: str
    number: int = 0  # migrations before this try
    migration: inference_pb2.Migration | None = None
    decode_worker: WorkerEntry | None = None
    decode_started: bool = False

    @classmethod
    def after(cls, previous: Attempt, broken: Broken, request_id: str, num_tokens: int) -> Attempt:
        """The try that follows ``previous`` (of request ``request_id``) after ``broken``, with
        ``num_tokens`` tokens streamed so far."""
        number = previous.number + 1
        migration = inference_pb2.Migration(
            from_worker=broken.worker_id, tokens_streamed=num_tokens, reason=broken.reason
        )
        return cls(f"{request_id}.m{number}", number, migration)

    @property
    def is_first(self) -> bool:
        return self.number == 0
