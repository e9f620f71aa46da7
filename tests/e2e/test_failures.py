"""Failures end to end: a prefill worker killed under load, a decode worker drained by SIGTERM,
and what clients get once a role has no worker left. The tests run in order on one deployment
(2 prefill + 1 decode workers, ``--disaggregation always``, lease TTL 3 s)."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve import LLM, SamplingParams
from pdserve.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.deployment import Deployment, long_context_copy
from tests.e2e.prompts import shared_prefix_prompts

pytestmark = pytest.mark.slow
MODEL = "e2e-failures"
LEASE_TTL_S = 3.0
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def cluster(checkpoints, etcd_url, tmp_path_factory):
    path = long_context_copy(checkpoints("llama")[0], tmp_path_factory.mktemp("llama"), 4096)
    deployment = Deployment(str(path), etcd_url, prefill=2, decode=1, model_name=MODEL, disaggregation="always")
    yield deployment, path
    deployment.close()


def test_killing_a_prefill_worker_under_load_retries_or_fails_fast(cluster):
    deployment, path = cluster
    prompts = shared_prefix_prompts(40, seed=7)
    expected = LLM(str(path)).generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    victim = deployment.worker("prefill", 0)
    outcomes: list[tuple[str, float, object]] = [("", 0.0, None)] * len(prompts)

    def one(i: int) -> None:
        time.sleep(0.05 * i)  # arrivals spread over 2 s; the kill lands in the middle
        start = time.monotonic()
        try:
            result = deployment.generate(prompts[i], timeout=DEADLINE_S, max_tokens=16, temperature=0, ignore_eos=True)
            outcomes[i] = ("ok", time.monotonic() - start, result)
        except grpc.RpcError as exc:
            outcomes[i] = (exc.code().name, time.monotonic() - start, exc.details())

    killer = threading.Timer(0.6, deployment.kill, args=(victim, signal.SIGKILL))
    killer.start()
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(one, range(len(prompts))))
    killer.join()
    for i, (status, seconds, result) in enumerate(outcomes):
        assert status in ("ok", "UNAVAILABLE"), (victim.name, i, status, result)
        assert seconds < DEADLINE_S
        if status == "ok":
            assert result["token_ids"] == expected[i].token_ids
    retried = [r for s, _, r in outcomes if s == "ok" and r["final"].breakdown.prefill_attempts == 2]
    assert retried, "no request was retried on the surviving prefill worker"
    assert sum(s == "ok" for s, _, _ in outcomes) >= len(prompts) // 2
    # The dead worker's lease runs out and it leaves routing.
    deployment.wait_registered(
        lambda ws: sum(w.role == "prefill" for w in ws) == 1, LEASE_TTL_S + 3, "the lease to expire"
    )
    time.sleep(0.2)  # the frontend watches the registry: the lease's end reached it in milliseconds
    for prompt, want in zip(prompts[:4], expected[:4]):
        result = deployment.generate(prompt, max_tokens=16, temperature=0, ignore_eos=True)
        assert result["token_ids"] == want.token_ids and result["final"].breakdown.prefill_attempts == 1


def test_sigterm_drains_a_decode_worker_in_flight_streams_finish(cluster):
    deployment, _ = cluster
    decode = deployment.worker("decode")
    started = threading.Barrier(9)
    results: list[object] = [None] * 8

    def one(i: int) -> None:
        request = inference_pb2.GenerateRequest(
            model=MODEL,
            token_ids=inference_pb2.TokenIds(ids=[2 + i, 3, 4, 5]),
            sampling=inference_pb2.SamplingOptions(max_tokens=600, ignore_eos=True, seed=i),
        )
        tokens, final = [], None
        try:
            for n, response in enumerate(deployment.stub.Generate(request, timeout=DEADLINE_S)):
                tokens += response.token_ids
                if n == 1:
                    started.wait(10)
                if response.HasField("final"):
                    final = response.final
            results[i] = (len(tokens), final.finish_reason)
        except grpc.RpcError as exc:
            results[i] = exc.code().name

    # A Decode call opened beside a prefill that has not ended yet is in flight too.
    workers = deployment.registered()
    prefill_entry = next(w for w in workers if w.role == "prefill")
    decode_entry = next(w for w in workers if w.role == "decode")
    prompt, sampling = [7, 8, 9, 10], inference_pb2.SamplingOptions(max_tokens=5, temperature=0, ignore_eos=True)
    pending = worker_pb2.KVSource(worker_id=prefill_entry.worker_id, peer_info=prefill_entry.nixl, pending=True)
    decode_channel = grpc.insecure_channel(decode_entry.endpoint)
    waiting = worker_pb2_grpc.WorkerStub(decode_channel).Decode(
        worker_pb2.DecodeRequest(request_id="waiting-1", prompt_token_ids=prompt, sampling=sampling, kv_source=pending),
        timeout=DEADLINE_S,
    )
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    started.wait(20)
    deployment.kill(decode, signal.SIGTERM)
    deployment.wait_registered(
        lambda ws: any(w.role == "decode" and w.draining for w in ws), 3, "the decode worker to report draining"
    )
    for t in threads:
        t.join(DEADLINE_S)
    assert results == [(600, "length")] * 8
    time.sleep(0.5)  # a drain that counted only the engine's requests would be over by now
    assert decode.process.returncode is None
    with grpc.insecure_channel(prefill_entry.endpoint) as channel:
        worker_pb2_grpc.WorkerStub(channel).Prefill(
            worker_pb2.PrefillRequest(
                request_id="waiting-1",
                prompt_token_ids=prompt,
                sampling=sampling,
                kv_consumer=decode_entry.endpoint,
            ),
            timeout=DEADLINE_S,
        )
    streamed = list(waiting)
    decode_channel.close()
    assert sum(len(r.token_ids) for r in streamed) == 4 and streamed[-1].final.finish_reason == "length"
    assert deployment.run(decode.process.wait(), timeout=30) == 0
    deployment.wait_registered(lambda ws: not any(w.role == "decode" for w in ws), 3, "the decode worker to leave")


def test_no_worker_of_a_role_is_unavailable(cluster):
    deployment, _ = cluster
    with pytest.raises(grpc.RpcError) as error:
        deployment.generate([1, 2, 3], max_tokens=2)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no decode worker is available" in error.value.details()
