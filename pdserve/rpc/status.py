"""Refusals with a meaning across processes, typed in the call's trailing metadata.

A worker that refuses a call before starting anything for it aborts the call with UNAVAILABLE
and a ``pdserve.v1.Refusal`` (worker.proto) serialized under ``REFUSAL_KEY``; the caller reads
the reason back with ``refusal_reason`` and may send the call elsewhere. The status details
are for people; nothing parses them.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from pdserve.v1 import worker_pb2

# A binary metadata key (gRPC requires the "-bin" suffix for bytes values).
REFUSAL_KEY = "pdserve-refusal-bin"
DRAINING = worker_pb2.Refusal.REASON_DRAINING
KV_SOURCE_FAILED = worker_pb2.Refusal.REASON_KV_SOURCE_FAILED


async def refuse(context: grpc.aio.ServicerContext, reason: worker_pb2.Refusal.Reason, details: str) -> None:
    """End the call (this raises) with UNAVAILABLE, ``details`` for people and ``reason`` for programs."""
    refusal = worker_pb2.Refusal(reason=reason).SerializeToString()
    await context.abort(grpc.StatusCode.UNAVAILABLE, details, trailing_metadata=((REFUSAL_KEY, refusal),))


def refusal_reason(error: grpc.aio.AioRpcError) -> worker_pb2.Refusal.Reason | None:
    """Why a worker refused the call that failed with ``error``; None when it was no refusal."""
    if error.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    for key, value in error.trailing_metadata() or ():
        if key == REFUSAL_KEY and isinstance(value, bytes):
            try:
                return worker_pb2.Refusal.FromString(value).reason
            except DecodeError:
                return None
    return None
