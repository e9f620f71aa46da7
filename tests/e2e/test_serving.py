"""Disaggregated serving end to end: real etcd, real worker processes, real NIXL, real gRPC.

One deployment (2 prefill + 1 decode workers of a tiny Llama, ``--disaggregation always``) is
shared by the tests here; each test leaves it idle and whole.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import msgspec
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve import LLM, SamplingParams
from pdserve.kvtransfer.messages import PeerInfo
from pdserve.rpc.status import refusal_reason
from pdserve.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.deployment import Deployment, Frontend, collect, long_context_copy
from tests.e2e.prompts import shared_prefix_prompts
from tests.utils.checkpoints import reference_greedy
from tests.utils.stop_strings import stop_after_the_first_token

pytestmark = pytest.mark.slow
MODEL = "e2e-llama"
LONG_CONTEXT = 8192


@pytest.fixture(scope="module")
def llama(checkpoints, etcd_url, tmp_path_factory):
    # A longer context than the shared checkpoint's, so that a stream can outlast the checks
    # made while it runs (the weights, and so the reference, are the same).
    path = long_context_copy(checkpoints("llama")[0], tmp_path_factory.mktemp("llama"), LONG_CONTEXT)
    hf_model = checkpoints("llama")[1]
    deployment = Deployment(str(path), etcd_url, prefill=2, decode=1, model_name=MODEL, disaggregation="always")
    yield deployment, path, hf_model
    deployment.close()


def _idle(workers) -> bool:
    return len(workers) == 3 and all(
        w.load.kv_blocks_used == 0 and w.load.held_requests == 0 and w.load.running == 0 for w in workers
    )


def test_greedy_tokens_over_the_disaggregated_path_equal_the_offline_engine(llama):
    deployment, path, hf_model = llama
    prompts = shared_prefix_prompts(32)
    expected = LLM(str(path)).generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    # The offline engine itself equals transformers (tests/engine); spot-check it here too.
    for prompt, out in zip(prompts[:3], expected[:3]):
        reference, clear = reference_greedy(hf_model, prompt, 12)
        assert clear >= 6 and out.token_ids[:clear] == reference[:clear]

    def one(prompt):
        return deployment.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True)

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, prompts))
    for prompt, result, want in zip(prompts, results, expected):
        assert result["token_ids"] == want.token_ids, prompt
        final = result["final"]
        assert final.finish_reason == "length" and final.usage.completion_tokens == 12
        b = final.breakdown
        assert b.disaggregated and b.prefill_worker.startswith("prefill-") and b.decode_worker.startswith("decode-")
        assert b.kv_transfer_bytes > 0 and b.kv_transfer_ms > 0 and b.ttft_ms <= b.e2e_ms
    # Shared prefixes were routed to where they were cached.
    assert sum(r["final"].usage.cached_prompt_tokens for r in results) >= 16 * 10
    deployment.wait_registered(_idle, 10, "every block free again")


def test_generate_cli_against_the_server_prints_the_contract_json(llama):
    deployment, path, _ = llama
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "generate",
            "--target",
            f"127.0.0.1:{deployment.port}",
            "--token-ids",
            "5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21",
            "--max-tokens",
            "6",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    want = LLM(str(path)).generate([list(range(5, 22))], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[
        0
    ]
    assert out["token_ids"] == want.token_ids and out["finish_reason"] == "length"
    assert out["ttft_ms"] > 0 and out["itl_ms"] > 0
    b = out["breakdown"]
    for key in ("prefill_worker", "decode_worker", "queue_ms", "prefill_ms", "kv_transfer_ms", "kv_transfer_bytes"):
        assert key in b, key
    assert b["prefill_worker"] != b["decode_worker"] and b["kv_transfer_bytes"] > 0
    assert (b["migrations"], b["migration_history"]) == (0, [])  # nothing broke


def test_text_prompts_stream_text(llama):
    deployment, path, _ = llama
    result = deployment.generate("hello world", max_tokens=8, seed=3, ignore_eos=True)
    want = LLM(str(path)).generate(["hello world"], SamplingParams(max_tokens=8, seed=3, ignore_eos=True))[0]
    assert result["token_ids"] == want.token_ids
    assert result["text"] == result["final"].text == want.text


@pytest.mark.parametrize("max_tokens", [1, 8])
def test_a_stop_string_straddling_the_first_token_streams_each_character_once(llama, max_tokens):
    # The first token (the prefill worker's) ends in what may begin the stop string: the
    # frontend holds that character back, then sends it at the end (max_tokens=1) or cuts it
    # when a decode worker's token completes the stop (max_tokens=8). It then ends the decode
    # call, which aborts the request on the decode worker and frees its blocks.
    deployment, path, _ = llama
    offline = LLM(str(path))
    prompt, stop = stop_after_the_first_token(offline, completes=max_tokens > 1)
    want = offline.generate(
        [prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    result = deployment.generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, stop=[stop])
    breakdown = result["final"].breakdown
    assert breakdown.disaggregated
    # The decode worker reported its pull (DecodeStarted) before the frontend ended the call.
    assert breakdown.decode_worker and breakdown.kv_transfer_bytes > 0 and breakdown.kv_transfer_ms > 0
    assert (result["text"], result["final"].text, result["final"].finish_reason) == (
        want.text,
        want.text,
        want.finish_reason,
    )
    assert result["token_ids"] == want.token_ids and result["final"].usage.completion_tokens == len(want.token_ids)
    deployment.wait_registered(_idle, 10, "every block free after the stop")


def test_cancelling_a_stream_frees_its_blocks_on_both_workers(llama):
    deployment, _, _ = llama
    request = inference_pb2.GenerateRequest(
        model=MODEL,
        token_ids=inference_pb2.TokenIds(ids=list(range(2, 90))),
        sampling=inference_pb2.SamplingOptions(max_tokens=LONG_CONTEXT - 100, temperature=0, ignore_eos=True),
    )
    call = deployment.stub.Generate(request, timeout=60)
    stream = iter(call)
    next(stream), next(stream)  # the first token (prefill worker), then one from the decode worker
    deployment.wait_registered(
        lambda ws: any(w.role == "decode" and w.load.kv_blocks_used > 0 for w in ws), 5, "the decode worker busy"
    )
    call.cancel()
    deployment.wait_registered(_idle, 10, "every block free after the cancel")


def test_a_decode_call_opened_before_its_prompt_is_started_by_the_prefill_workers_kv_ready(llama):
    """The worker API as the frontend uses it, without the frontend: nobody but the prefill
    worker tells the decode worker where the KV is (a missing KVReady fails the call at its deadline)."""
    deployment, path, _ = llama
    workers = deployment.registered()
    prefill = next(w for w in workers if w.role == "prefill")
    decode = next(w for w in workers if w.role == "decode")
    prompt = list(range(5, 75))
    want = LLM(str(path)).generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    sampling = inference_pb2.SamplingOptions(max_tokens=8, temperature=0, ignore_eos=True)
    with grpc.insecure_channel(prefill.endpoint) as p, grpc.insecure_channel(decode.endpoint) as d:
        decode_stub = worker_pb2_grpc.WorkerStub(d)
        pending = worker_pb2.KVSource(worker_id=prefill.worker_id, peer_info=prefill.nixl, pending=True)
        call = decode_stub.Decode(
            worker_pb2.DecodeRequest(
                request_id="early-1", prompt_token_ids=prompt, sampling=sampling, kv_source=pending
            ),
            timeout=20,
        )
        first = worker_pb2_grpc.WorkerStub(p).Prefill(
            worker_pb2.PrefillRequest(
                request_id="early-1",
                prompt_token_ids=prompt,
                sampling=sampling,
                kv_consumer=decode.endpoint,
            ),
            timeout=20,
        )
        responses = list(call)
        source = worker_pb2.KVSource(
            worker_id=prefill.worker_id,
            block_ids=first.block_ids,
            first_token_id=first.first_token_id,
            pull_within_s=10,
        )
        repeat = decode_stub.KVReady(worker_pb2.KVReadyRequest(request_id="early-1", kv_source=source), timeout=5)
    assert responses[0].started.kv_transfer_bytes > 0  # pulled, not computed
    assert [first.first_token_id, *(t for r in responses for t in r.token_ids)] == want.token_ids
    assert responses[-1].final.finish_reason == "length"
    assert not repeat.accepted  # what the frontend sends too, once the Prefill call returns
    deployment.wait_registered(_idle, 10, "every block free after the pull")


def test_a_pending_decode_call_whose_kv_never_comes_ends_at_its_deadline_holding_nothing(llama):
    deployment, _, _ = llama
    workers = deployment.registered()
    prefill = next(w for w in workers if w.role == "prefill")
    decode = next(w for w in workers if w.role == "decode")
    sampling = inference_pb2.SamplingOptions(max_tokens=8)
    with grpc.insecure_channel(decode.endpoint) as d:
        stub = worker_pb2_grpc.WorkerStub(d)
        pending = worker_pb2.KVSource(worker_id=prefill.worker_id, peer_info=prefill.nixl, pending=True)
        call = stub.Decode(
            worker_pb2.DecodeRequest(
                request_id="never-1", prompt_token_ids=list(range(5, 40)), sampling=sampling, kv_source=pending
            ),
            timeout=1.5,
        )
        deployment.wait_registered(_idle, 1, "a waiting call takes no blocks")
        with pytest.raises(grpc.RpcError) as waited:
            list(call)
        assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.RpcError) as bad:
            stub.KVReady(
                worker_pb2.KVReadyRequest(
                    request_id="never-2", kv_source=worker_pb2.KVSource(worker_id=prefill.worker_id, first_token_id=3)
                ),
                timeout=5,
            )
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_source.block_ids" in bad.value.details()
    deployment.wait_registered(_idle, 10, "nothing held after the deadline")


def test_a_kv_source_whose_agent_cannot_be_loaded_is_refused_as_kv_source_failed(llama):
    """NIXL failing to load the prefill side (here: metadata no agent wrote; in life, a prefill
    worker gone meanwhile) is the source's fault: the refusal says so, so that the frontend
    prefills again elsewhere and keeps this decode worker."""
    deployment, _, _ = llama
    workers = deployment.registered()
    prefill = next(w for w in workers if w.role == "prefill")
    decode = next(w for w in workers if w.role == "decode")
    real = PeerInfo.decode(prefill.nixl)
    ghost = msgspec.structs.replace(real, agent_name="ghost-agent", agent_metadata=b"not nixl metadata")
    source = worker_pb2.KVSource(
        worker_id="ghost", peer_info=ghost.encode(), block_ids=[0], first_token_id=3, pull_within_s=10
    )
    with grpc.insecure_channel(decode.endpoint) as d:
        call = worker_pb2_grpc.WorkerStub(d).Decode(
            worker_pb2.DecodeRequest(
                request_id="ghost-1",
                prompt_token_ids=list(range(5, 40)),
                sampling=inference_pb2.SamplingOptions(max_tokens=4),
                kv_source=source,
            ),
            timeout=20,
        )
        with pytest.raises(grpc.RpcError) as refused:
            list(call)
    assert refusal_reason(refused.value) == worker_pb2.Refusal.REASON_KV_SOURCE_FAILED
    assert "loading ghost as a NIXL peer failed" in refused.value.details()
    deployment.wait_registered(_idle, 10, "nothing held after the refusal")


def test_bad_requests_get_invalid_argument_naming_the_field_and_workers_stay_up(llama):
    deployment, _, _ = llama
    cases = [
        ([], {}, "prompt: empty"),
        ("", {}, "prompt: text is empty"),
        ([1, 2, 320], {}, "token_ids[2] = 320 is outside the vocabulary [0, 320)"),
        (list(range(2, 300)) * 30, {}, "max_model_len"),
        ([1, 2, 3], {"max_tokens": 0}, "max_tokens"),
        ([1, 2, 3], {"max_tokens": 9000}, "sampling.max_tokens = 9000 exceeds"),
        ([1, 2, 3], {"temperature": -1.0}, "temperature"),
        ([1, 2, 3], {"top_p": 1.5}, "top_p"),
    ]
    for prompt, sampling, message in cases:
        with pytest.raises(grpc.RpcError) as error:
            deployment.generate(prompt, **sampling)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (prompt, sampling)
        assert message in error.value.details()
    request = inference_pb2.GenerateRequest(model="no-such-model", token_ids=inference_pb2.TokenIds(ids=[1, 2]))
    with pytest.raises(grpc.RpcError) as error:
        list(deployment.stub.Generate(request, timeout=10))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND and "'no-such-model' is not served" in error.value.details()
    assert deployment.generate([1, 2, 3], max_tokens=2)["final"].finish_reason == "length"
    assert not deployment.cluster.exited()


def test_queue_limit_gives_resource_exhausted(llama, etcd_url):
    deployment, _, _ = llama
    frontend = Frontend(etcd_url, "--max-queued-requests", "1", "--disaggregation", "always")
    try:
        request = inference_pb2.GenerateRequest(
            model=MODEL,
            token_ids=inference_pb2.TokenIds(ids=[3, 4, 5]),
            sampling=inference_pb2.SamplingOptions(max_tokens=300, ignore_eos=True),
        )
        first = frontend.stub.Generate(request, timeout=60)
        next(iter(first))  # in flight
        with pytest.raises(grpc.RpcError) as error:
            list(frontend.stub.Generate(request, timeout=10))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queued_requests" in error.value.details()
        first.cancel()
    finally:
        frontend.close()
    deployment.wait_registered(_idle, 10, "every block free")


def test_conditional_disaggregation_prefills_short_prompts_on_the_decode_worker(llama, etcd_url):
    deployment, path, _ = llama
    frontend = Frontend(etcd_url, "--disaggregation", "conditional", "--local-prefill-threshold", "32")
    try:
        results = {}
        for name, prompt in (("short", list(range(2, 20))), ("long", list(range(100, 180)))):
            request = inference_pb2.GenerateRequest(
                model=MODEL,
                token_ids=inference_pb2.TokenIds(ids=prompt),
                sampling=inference_pb2.SamplingOptions(max_tokens=5, temperature=0, ignore_eos=True),
            )
            responses = list(frontend.stub.Generate(request, timeout=60))
            tokens = [t for r in responses for t in r.token_ids]
            want = LLM(str(path)).generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
            assert tokens == want[0].token_ids
            results[name] = responses[-1].final.breakdown
        assert not results["short"].disaggregated and results["short"].prefill_worker == results["short"].decode_worker
        assert results["short"].kv_transfer_bytes == 0
        assert results["long"].disaggregated and results["long"].kv_transfer_bytes > 0
    finally:
        frontend.close()


def _assert_logprobs_equal(served, offline, n: int) -> None:
    """Served logprobs (wire) equal the offline engine's: the token's own and the top-n's ids
    exactly; values to float32 rounding (the batch the rows ran in may differ)."""
    assert len(served) == len(offline)
    for wire, want in zip(served, offline):
        assert wire.logprob == pytest.approx(want.token_logprob, abs=1e-4)
        assert len(wire.top) == n and [t.token_id for t in wire.top] == [t for t, _ in want.top]
        assert [t.logprob for t in wire.top] == pytest.approx([v for _, v in want.top], abs=1e-4)


@pytest.mark.parametrize("disaggregation", ["always", "off"])
def test_logprobs_over_grpc_equal_the_offline_engines(llama, etcd_url, disaggregation):
    """The first token's logprobs come from the prefill worker (always) or the decode worker
    (off: colocated), the rest from the decode worker; greedy and seeded sampling alike."""
    deployment, path, _ = llama
    frontend = Frontend(etcd_url, "--disaggregation", disaggregation) if disaggregation == "off" else None
    stub = frontend.stub if frontend is not None else deployment.stub
    offline = LLM(str(path))
    try:
        for prompt, options in (
            (list(range(40, 75)), dict(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)),
            (list(range(7, 30)), dict(max_tokens=5, temperature=0.9, seed=11, ignore_eos=True, logprobs=5)),
            (list(range(90, 110)), dict(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0)),
        ):
            request = inference_pb2.GenerateRequest(
                model=MODEL,
                token_ids=inference_pb2.TokenIds(ids=prompt),
                sampling=inference_pb2.SamplingOptions(**options),
            )
            result = collect(stub.Generate(request, timeout=60))
            want = offline.generate([prompt], SamplingParams(**options))[0]
            assert result["token_ids"] == want.token_ids
            assert result["final"].breakdown.disaggregated == (disaggregation == "always")
            _assert_logprobs_equal(result["logprobs"], want.logprobs, options["logprobs"])
        plain = deployment.generate([5, 6, 7], max_tokens=3, temperature=0)
        assert plain["logprobs"] == []  # not asked for: none sent
    finally:
        if frontend is not None:
            frontend.close()
    deployment.wait_registered(_idle, 10, "every block free")


def _pdserve(*args: str, etcd: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *args, "--etcd", etcd], capture_output=True, text=True, timeout=60
    )


def test_live_knobs_retune_the_workers_and_the_router_without_a_restart(llama, etcd_url):
    deployment, path, _ = llama
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)

    def generate(stub, prompt):
        request = inference_pb2.GenerateRequest(
            model=MODEL,
            token_ids=inference_pb2.TokenIds(ids=prompt),
            sampling=inference_pb2.SamplingOptions(max_tokens=5, temperature=0, ignore_eos=True),
        )
        responses = list(stub.Generate(request, timeout=60))
        return [t for r in responses for t in r.token_ids], responses[-1].final.breakdown

    def limits(workers, role):
        return {(w.load.max_num_seqs, w.load.max_num_batched_tokens) for w in workers if w.role == role}

    start_up = {
        role: {(w.max_num_seqs, w.max_num_batched_tokens) for w in deployment.registered() if w.role == role}
        for role in ("prefill", "decode")
    }
    prompts = [list(range(150, 190)), list(range(200, 240)), list(range(250, 290))]
    want = [out.token_ids for out in LLM(str(path)).generate(prompts, greedy)]
    frontend = Frontend(etcd_url, "--disaggregation", "conditional", "--local-prefill-threshold", "0")
    try:
        tokens, before = generate(frontend.stub, prompts[0])
        assert tokens == want[0] and before.disaggregated
        stored = _pdserve(
            "knobs",
            "set",
            "--model",
            MODEL,
            "--local-prefill-threshold",
            "1000",
            "--decode-max-num-seqs",
            "2",
            "--prefill-chunk-size",
            "16",
            etcd=etcd_url,
        )
        assert stored.returncode == 0, stored.stderr
        [(_, decode_tokens)] = start_up["decode"]
        retuned = {"decode": {(2, decode_tokens)}, "prefill": {(16, 16)}}  # a prefill step fits 16 sequences at most
        deployment.wait_registered(
            lambda ws: {r: limits(ws, r) for r in start_up} == retuned, 10, "the workers' new scheduler limits"
        )
        time.sleep(0.2)  # the frontend watches the registry: the knobs reached it in milliseconds
        tokens, local = generate(frontend.stub, prompts[1])
        assert tokens == want[1] and not local.disaggregated and local.kv_transfer_bytes == 0
        # The always-disaggregating frontend still uses the prefill pool, now in chunks of 16 tokens.
        tokens, chunked = generate(deployment.stub, prompts[2])
        assert tokens == want[2] and chunked.disaggregated
        reset = _pdserve("knobs", "reset", "--model", MODEL, etcd=etcd_url)
        assert reset.returncode == 0, reset.stderr
        deployment.wait_registered(
            lambda ws: {r: limits(ws, r) for r in start_up} == start_up, 10, "the start-up limits back"
        )
    finally:
        _pdserve("knobs", "reset", "--model", MODEL, etcd=etcd_url)  # the next tests share the deployment
        frontend.close()


def test_health_reflection_and_list_models(llama):
    deployment, _, _ = llama
    health = health_pb2_grpc.HealthStub(deployment.channel)
    assert (
        health.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Inference")).status
        == health_pb2.HealthCheckResponse.SERVING
    )
    reflection = reflection_pb2_grpc.ServerReflectionStub(deployment.channel)
    [answer] = list(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in answer.list_services_response.service}
    assert {"pdserve.v1.Inference", "grpc.health.v1.Health"} <= names
    models = deployment.stub.ListModels(inference_pb2.ListModelsRequest(), timeout=10).models
    [info] = [m for m in models if m.name == MODEL]
    assert (info.prefill_workers, info.decode_workers, info.vocab_size, info.max_model_len) == (2, 1, 320, LONG_CONTEXT)


def test_concurrent_load_leaves_nothing_behind(llama):
    """Many overlapping streams, some cancelled midway: the pools end whole."""
    deployment, _, _ = llama
    prompts = shared_prefix_prompts(24, seed=1)

    def one(i):
        request = inference_pb2.GenerateRequest(
            model=MODEL,
            token_ids=inference_pb2.TokenIds(ids=prompts[i]),
            sampling=inference_pb2.SamplingOptions(max_tokens=40, ignore_eos=True, seed=i),
        )
        call = deployment.stub.Generate(request, timeout=60)
        for n, _ in enumerate(call):
            if i % 3 == 0 and n == 2:
                call.cancel()
                return "cancelled"
        return "done"

    with ThreadPoolExecutor(24) as pool:
        outcomes = list(pool.map(one, range(24)))
    assert outcomes.count("done") == 16
    deployment.wait_registered(_idle, 15, "every block free")
    assert threading.active_count() < 50


def test_every_process_exposes_prometheus_metrics(llama):
    deployment, _, _ = llama
    deployment.generate(list(range(2, 40)), max_tokens=4, temperature=0)

    def scrape(port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return response.read().decode()

    def value(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    for worker in deployment.registered():
        assert worker.metrics_port, worker.worker_id
        text = scrape(worker.metrics_port)
        assert value(text, "pdserve_prompt_tokens_total") > 0 or worker.role == "prefill"
        if worker.role == "decode":
            assert value(text, "pdserve_kv_transfer_bytes_total") > 0
    assert deployment.cluster.frontend is not None
    [line] = [line for line in deployment.cluster.frontend.output if "metrics on" in line]
    text = scrape(int(line.rsplit(":", 1)[1].split("/")[0]))
    assert value(text, "pdserve_ttft_seconds_count") >= 1 and value(text, "pdserve_itl_seconds_count") >= 3
