"""Typed refusals: a reason in the trailing metadata, read back by the caller over real gRPC."""

from __future__ import annotations

import grpc
import pytest

from pdserve.rpc.status import DRAINING, REFUSAL_KEY, refusal_reason, refuse
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.utils.aio import run_scenario

TYPED = ((REFUSAL_KEY, worker_pb2.Refusal(reason=DRAINING).SerializeToString()),)
# request id -> how Release fails without ``refuse``: (code, trailing metadata)
UNTYPED = {
    "plain": (grpc.StatusCode.UNAVAILABLE, ()),
    "garbled": (grpc.StatusCode.UNAVAILABLE, ((REFUSAL_KEY, b"\xff\xff"),)),
    "internal": (grpc.StatusCode.INTERNAL, TYPED),  # a refusal is UNAVAILABLE, whatever the metadata
}


class Refusing(worker_pb2_grpc.WorkerServicer):
    """Release fails as its request id says."""

    async def Release(self, request, context):
        if request.request_id == "draining":
            await refuse(context, DRAINING, "worker w1 takes no new requests")
        code, metadata = UNTYPED[request.request_id]
        await context.abort(code, "draining: worker w1 takes no new requests", trailing_metadata=metadata)


@pytest.mark.parametrize(
    ("request_id", "reason"), [("draining", DRAINING), ("plain", None), ("garbled", None), ("internal", None)]
)
def test_a_refusal_reason_is_read_from_the_trailing_metadata_not_the_details(request_id, reason):
    async def main():
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(Refusing(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await stub.Release(worker_pb2.ReleaseRequest(request_id=request_id), timeout=10)
                return error.value
        finally:
            await server.stop(None)

    error = run_scenario(main(), timeout_s=30)
    assert refusal_reason(error) == reason
    if request_id == "draining":
        assert error.code() == grpc.StatusCode.UNAVAILABLE and error.details() == "worker w1 takes no new requests"
