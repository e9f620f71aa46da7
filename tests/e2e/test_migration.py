"""A decode worker SIGKILLed mid-stream: every request on it migrates to the other decode worker
and completes with exactly the tokens of an undisturbed run (greedy and seeded), one stream
each; the supervisor (as in ``pdserve up``) restarts the worker, two decode workers are live
again within 60 s, and the pools end whole. Real processes (1 prefill + 2 decode,
``--disaggregation always``), real etcd, real NIXL; the reference is the offline engine."""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Any

import grpc
import pytest

from pdserve import LLM, SamplingParams
from pdserve.v1 import inference_pb2
from pdserve.launch.supervisor import RestartPolicy
from tests.e2e.deployment import Deployment, long_context_copy, scrape
from tests.e2e.prompts import shared_prefix_prompts

pytestmark = pytest.mark.slow
MODEL = "e2e-migration"
DEADLINE_S = 120.0
# The scenario is 12 greedy streams of 300 tokens, one decode worker SIGKILLed. Since decode
# steps got fast, 300 tokens can all be out before the last stream reaches the kill's barrier; 1000
# keep every stream busy for seconds, so the kill always meets streams on the victim.
MAX_TOKENS = 1000
NUM_GREEDY = 12
SEEDS = (11, 12)  # two seeded, sampled streams besides the greedy ones
MESSAGES_BEFORE_KILL = 4  # every stream has this many messages before the kill: all are mid-stream


@pytest.fixture(scope="module")
def cluster(checkpoints, etcd_url, tmp_path_factory):
    path = long_context_copy(checkpoints("llama")[0], tmp_path_factory.mktemp("llama"), 4096)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        metrics_port = sock.getsockname()[1]
    deployment = Deployment(
        str(path),
        etcd_url,
        prefill=1,
        decode=2,
        model_name=MODEL,
        disaggregation="always",
        frontend_fields={"metrics_port": metrics_port},
        restart=RestartPolicy(),
    )
    yield deployment, path, metrics_port
    deployment.close()


def _params(i: int) -> dict[str, Any]:
    if i < NUM_GREEDY:
        return {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return {
        "max_tokens": MAX_TOKENS,
        "temperature": 0.8,
        "top_p": 0.95,
        "seed": SEEDS[i - NUM_GREEDY],
        "ignore_eos": True,
    }


def test_sigkill_of_a_decode_worker_mid_stream_loses_no_request_and_no_token(cluster):
    deployment, path, metrics_port = cluster
    prompts = shared_prefix_prompts(NUM_GREEDY + len(SEEDS), seed=3)
    count = len(prompts)
    expected = LLM(str(path)).generate(prompts, [SamplingParams(**_params(i)) for i in range(count)])
    victim = deployment.worker("decode", 0)
    victim_id_suffix = f"-{victim.process.pid}"
    mid_stream = threading.Barrier(count + 1)
    results: list[Any] = [None] * count

    def one(i: int) -> None:
        request = inference_pb2.GenerateRequest(
            model=MODEL,
            token_ids=inference_pb2.TokenIds(ids=prompts[i]),
            sampling=inference_pb2.SamplingOptions(**_params(i)),
        )
        tokens: list[int] = []
        final = None
        try:
            for n, response in enumerate(deployment.stub.Generate(request, timeout=DEADLINE_S)):
                tokens += response.token_ids
                if n == MESSAGES_BEFORE_KILL:
                    mid_stream.wait(60)
                if response.HasField("final"):
                    final = response.final
            results[i] = (tokens, final)
        except grpc.RpcError as exc:
            results[i] = (tokens, f"{exc.code().name}: {exc.details()}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    mid_stream.wait(90)
    deployment.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(DEADLINE_S + 10)
    migrated = 0
    for i, (tokens, final) in enumerate(results):
        assert isinstance(final, inference_pb2.Final), (i, final)
        assert tokens == expected[i].token_ids, f"stream {i} differs from the undisturbed run"
        assert (final.finish_reason, final.usage.completion_tokens) == ("length", MAX_TOKENS)
        b = final.breakdown
        assert b.migrations == len(b.migration_history) <= 1
        if b.migrations:
            migrated += 1
            move = b.migration_history[0]
            assert move.from_worker.endswith(victim_id_suffix) and not b.decode_worker.endswith(victim_id_suffix)
            assert move.to_worker == b.decode_worker and 0 < move.tokens_streamed < MAX_TOKENS
    assert migrated, "no stream was on the killed worker"
    assert scrape(metrics_port)["pdserve_migrations_total"] == migrated  # the frontend counted each move

    # The dead worker leaves routing (its lease expires) and comes back under a new id: two live
    # decode workers again within 60 s, every pool whole: nothing running, nothing pinned.
    deployment.wait_registered(
        lambda ws: (
            sum(w.role == "decode" for w in ws) == 2
            and not any(w.worker_id.endswith(victim_id_suffix) for w in ws)
            and all(w.load.kv_blocks_used == 0 and w.load.held_requests == 0 and w.load.running == 0 for w in ws)
        ),
        60,
        "two live decode workers again (the killed one restarted), all idle and whole",
    )
    time.sleep(1.0)  # the frontend's view of the registry catches up
    again = deployment.generate(prompts[0], timeout=DEADLINE_S, **_params(0))
    assert again["token_ids"] == expected[0].token_ids and again["final"].breakdown.migrations == 0
