"""Request ids reused while their request runs, on a real deployment (1 prefill + 1 decode worker
of a tiny Llama): the repeat is refused, and the request holding the id runs to its end, whether
the repeat comes through the frontend or straight to a worker's RPCs."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.deployment import Deployment, long_context_copy

pytestmark = pytest.mark.slow
MODEL = "e2e-request-ids"
LONG_CONTEXT = 4096
NUM_TOKENS = 1500  # long enough a stream for the repeats to meet it in flight


@pytest.fixture(scope="module")
def deployment(checkpoints, etcd_url, tmp_path_factory):
    path = long_context_copy(checkpoints("llama")[0], tmp_path_factory.mktemp("llama"), LONG_CONTEXT)
    served = Deployment(str(path), etcd_url, prefill=1, decode=1, model_name=MODEL, disaggregation="always")
    yield served
    served.close()


def _idle(workers) -> bool:
    return len(workers) == 2 and all(w.load.kv_blocks_used == 0 and w.load.held_requests == 0 for w in workers)


def _sampling(max_tokens: int = NUM_TOKENS) -> inference_pb2.SamplingOptions:
    return inference_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_eight_requests_sharing_an_id_one_completes_and_seven_are_refused_at_once(deployment):
    request = inference_pb2.GenerateRequest(
        model=MODEL, token_ids=inference_pb2.TokenIds(ids=list(range(3, 30))), sampling=_sampling(), request_id="r1"
    )

    streaming = threading.Event()

    def first() -> list[inference_pb2.GenerateResponse]:
        responses = []
        for response in deployment.stub.Generate(request, timeout=120):
            responses.append(response)
            streaming.set()
        return responses

    def repeat() -> tuple[grpc.StatusCode, str, float]:
        started = time.monotonic()
        try:
            list(deployment.stub.Generate(request, timeout=120))
        except grpc.RpcError as error:
            return error.code(), error.details(), time.monotonic() - started
        return grpc.StatusCode.OK, "", time.monotonic() - started

    with ThreadPoolExecutor(8) as pool:
        running = pool.submit(first)
        assert streaming.wait(60)
        refused = [f.result(60) for f in [pool.submit(repeat) for _ in range(7)]]
        assert not running.done()
        responses = running.result(120)
    assert sum(len(r.token_ids) for r in responses) == NUM_TOKENS and responses[-1].final.finish_reason == "length"
    for code, details, took in refused:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "'r1' is already in use" in details, details
        assert took < 1.0, took
    deployment.wait_registered(_idle, 15, "every block free")


def test_a_worker_refuses_an_id_in_use_and_the_request_holding_it_is_untouched(deployment):
    """Straight to the workers, as any caller of their port can: a Decode running under the id,
    and a Prefill whose blocks are pinned under it, both survive a repeat."""
    workers = deployment.registered()
    prefill = next(w for w in workers if w.role == "prefill")
    decode = next(w for w in workers if w.role == "decode")
    prompt = list(range(5, 40))
    with grpc.insecure_channel(decode.endpoint) as d, grpc.insecure_channel(prefill.endpoint) as p:
        decode_stub, prefill_stub = worker_pb2_grpc.WorkerStub(d), worker_pb2_grpc.WorkerStub(p)
        message = worker_pb2.DecodeRequest(request_id="d1", prompt_token_ids=prompt, sampling=_sampling())
        call = decode_stub.Decode(message, timeout=120)
        assert next(call).token_ids  # running
        with pytest.raises(grpc.RpcError) as repeat:
            list(decode_stub.Decode(message, timeout=10))
        assert repeat.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already in use" in repeat.value.details()
        rest = list(call)
        assert rest[-1].final.finish_reason == "length"

        pinned = worker_pb2.PrefillRequest(request_id="p1", prompt_token_ids=prompt, sampling=_sampling(8))
        assert prefill_stub.Prefill(pinned, timeout=30).block_ids
        with pytest.raises(grpc.RpcError) as repeat:
            prefill_stub.Prefill(pinned, timeout=10)
        assert repeat.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already in use" in repeat.value.details()
        assert prefill_stub.Release(worker_pb2.ReleaseRequest(request_id="p1"), timeout=10).released  # pin intact
    deployment.wait_registered(_idle, 15, "every block free")
