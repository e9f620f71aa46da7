"""Data-parallel attention with expert parallelism served end to end (DeepSeek-V3): a prefill
worker of 2 DP ranks feeding a decode worker of 2 DP ranks, each rank a registered worker with
its own KV cache, the ranks of each sharing the experts by all-to-all and stepping together.
Real etcd, processes, gRPC, NIXL; transformers as the reference."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdserve.distributed.parallel_config import ParallelConfig
from pdserve.launch.supervisor import RestartPolicy
from pdserve.types.engine_config import EngineConfig
from pdserve.v1 import inference_pb2
from tests.e2e.deployment import Deployment, rank_children
from tests.utils.checkpoints import VOCAB, reference_greedy

pytestmark = pytest.mark.slow
DP2_EP = {"parallel": ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)}
MODEL = "dp-deepseek"
# Long enough that every stream is still generating when a rank is killed, however fast the steps.
STREAM_TOKENS = 120


@pytest.fixture(scope="module")
def groups(checkpoints, etcd_url):
    path, hf_model = checkpoints("deepseek_v3")
    deployment = Deployment(
        str(path),
        etcd_url,
        prefill=1,
        decode=1,
        model_name=MODEL,
        disaggregation="always",
        prefill_fields=DP2_EP,
        decode_fields=DP2_EP,
    )
    yield deployment, hf_model
    deployment.close()


def _idle(workers) -> bool:
    return len(workers) == 4 and all(
        w.load.kv_blocks_used == 0 and w.load.held_requests == 0 and w.load.running == 0 for w in workers
    )


def test_every_rank_registers_as_a_worker(groups):
    deployment, _ = groups
    workers = deployment.registered()
    for role in ("prefill", "decode"):
        ranks = sorted((w for w in workers if w.role == role), key=lambda w: w.worker_id)
        ids = [w.worker_id for w in ranks]
        assert len(ids) == 2 and ids[1] == f"{ids[0]}-dp1", ids
        assert [(w.group_id, w.group_size, w.group_rank) for w in ranks] == [(ids[0], 2, 0), (ids[0], 2, 1)]


def test_greedy_tokens_equal_transformers_with_kv_moved_on_every_rank(groups):
    deployment, hf_model = groups
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (9, 17, 33, 24, 40, 12, 28, 5)]
    with ThreadPoolExecutor(len(prompts)) as pool:  # at once: the router spreads them over the ranks
        results = list(
            pool.map(lambda p: deployment.generate(p, max_tokens=8, temperature=0, ignore_eos=True), prompts)
        )
    compared = 0
    for prompt, result in zip(prompts, results):
        reference, num_clear = reference_greedy(hf_model, prompt, 8)
        assert result["token_ids"][:num_clear] == reference[:num_clear], prompt
        compared += num_clear
        b = result["final"].breakdown
        # A request that migrated (its decode worker's lease lost under load) may resume from
        # the new decode worker's prefix cache, with nothing left to pull.
        assert b.disaggregated and (b.kv_transfer_bytes > 0 or b.migrations > 0), b
    assert compared >= len(prompts) * 4
    served = {(r["final"].breakdown.prefill_worker, r["final"].breakdown.decode_worker) for r in results}
    assert len({p for p, _ in served}) == 2 and len({d for _, d in served}) == 2, served
    deployment.wait_registered(_idle, 15, "every block free again on every rank")


def test_a_dead_rank_takes_its_whole_group_down(checkpoints, etcd_url):
    path, _ = checkpoints("deepseek_v3")
    deployment = Deployment(
        str(path),
        etcd_url,
        prefill=1,
        decode=1,
        model_name=f"{MODEL}-rank-dies",
        disaggregation="always",
        prefill_fields=DP2_EP,
        decode_fields=DP2_EP,
    )
    try:
        worker = deployment.worker("decode")
        (rank,) = rank_children([worker.process.pid], "pdserve.worker.data_parallel")
        assert deployment.generate(list(range(3, 30)), max_tokens=4, temperature=0, ignore_eos=True)["token_ids"]
        os.kill(rank, signal.SIGKILL)
        deployment.wait_registered(
            lambda ws: sorted(w.role for w in ws) == ["prefill", "prefill"],
            30,
            "both decode ranks gone from the registry",
        )
        assert deployment.run(worker.process.wait(), timeout=60) == 1  # rank 0 failed, for a restart
        deployment.wait_registered(
            lambda ws: all(w.load.kv_blocks_used == 0 and w.load.held_requests == 0 for w in ws),
            10,
            "the prefill ranks whole",
        )
    finally:
        deployment.close()


def test_streams_on_a_group_that_loses_a_rank_migrate_to_it_restarted(checkpoints, etcd_url):
    hf_model, deployment, rank = _restarting_group(checkpoints, etcd_url, "restart", DP2_EP)
    try:
        dying = {w.worker_id for w in deployment.registered() if w.role == "decode"}
        prompts = _prompts(12)
        # The whole decode group goes once every stream is under way; its supervisor starts it again.
        results = _streams_across_a_kill(deployment, prompts, rank, after_responses=3)
        for prompt, result in zip(prompts, results):
            assert result is not None, "a stream did not end by its deadline"
            tokens, final = result
            reference, num_clear = reference_greedy(hf_model, prompt, STREAM_TOKENS)
            assert tokens[:num_clear] == reference[:num_clear]
            # Every stream was on the group that died, and moved on to it restarted (new ids),
            # never to the dying group's other rank, still registered for a moment.
            assert 1 <= final.breakdown.migrations <= 2
            assert not {m.to_worker for m in final.breakdown.migration_history} & dying, final.breakdown
        deployment.wait_registered(
            lambda ws: (
                sorted(w.role for w in ws) == ["decode", "decode", "prefill"]
                and all(w.load.kv_blocks_used == 0 and w.load.held_requests == 0 for w in ws)
            ),
            30,
            "the decode group back, both ranks, and no block held anywhere",
        )
    finally:
        deployment.close()


def test_streams_on_a_group_that_loses_a_rank_migrate_to_another_group_never_to_a_sibling(checkpoints, etcd_url):
    """Two decode groups of 2 DP ranks, streams on all four ranks: killing group A's rank 1 fails
    A as a whole. Its streams move to group B's ranks, never to A's rank 0, which the router
    still sees registered (and idle, once its own streams broke) until its lease is gone."""
    path, hf_model = checkpoints("deepseek_v3")
    deployment = Deployment(
        str(path),
        etcd_url,
        prefill=1,
        decode=2,
        model_name=f"{MODEL}-two-groups",
        disaggregation="always",
        # Group B must keep its leases on this loaded machine: a stream that broke on a rank
        # whose lease lapsed would rightly avoid B's other rank too, and with A gone find no group.
        decode_fields={**DP2_EP, "lease_ttl_s": 10.0},
    )
    try:
        child = deployment.worker("decode", 0)
        (rank,) = rank_children([child.process.pid], "pdserve.worker.data_parallel")
        decode = [w for w in deployment.registered() if w.role == "decode"]
        (leader,) = [w for w in decode if w.endpoint == child.address]
        group_a = {w.worker_id for w in decode if w.group_id == leader.group_id}
        assert len(group_a) == 2 and len(decode) == 4, decode
        prompts = _prompts(14)
        results = _streams_across_a_kill(deployment, prompts, rank, after_responses=3)
        moved = 0
        for prompt, result in zip(prompts, results):
            assert result is not None, "a stream did not end by its deadline"
            tokens, final = result
            reference, num_clear = reference_greedy(hf_model, prompt, STREAM_TOKENS)
            assert len(tokens) == STREAM_TOKENS and tokens[:num_clear] == reference[:num_clear]
            b = final.breakdown
            assert b.decode_worker not in group_a, b
            assert not {m.to_worker for m in b.migration_history} & group_a, b
            moved += b.migrations > 0
        assert moved >= 1, "no stream was on group A when its rank died: the case was not reached"
        deployment.wait_registered(
            lambda ws: (
                sorted(w.role for w in ws) == ["decode", "decode", "prefill"]
                and not {w.worker_id for w in ws} & group_a
                and all(w.load.kv_blocks_used == 0 and w.load.held_requests == 0 for w in ws)
            ),
            30,
            "group A gone, group B whole, and no block held anywhere",
        )
    finally:
        deployment.close()


def test_a_stream_waiting_for_a_seat_on_a_failing_group_migrates_too(checkpoints, etcd_url):
    """One decode seat a rank: of four streams, one per rank decodes and one per rank waits for
    the seat (its first token, the prefill worker's, already streamed). Killing rank 1 fails
    rank 0's engine; the stream waiting there moves on like those being decoded, and none ends
    early."""
    decode = {**DP2_EP, "engine": EngineConfig(max_num_seqs=1)}
    hf_model, deployment, rank = _restarting_group(checkpoints, etcd_url, "seats", decode)
    try:
        rank0_id = next(w.worker_id for w in deployment.registered() if w.role == "decode" and "-dp" not in w.worker_id)
        prompts = _prompts(13)
        results = _streams_across_a_kill(deployment, prompts, rank, after_responses=1)
        waited_on_rank0 = 0
        for prompt, result in zip(prompts, results):
            assert result is not None, "a stream did not end by its deadline"
            tokens, final = result
            reference, num_clear = reference_greedy(hf_model, prompt, STREAM_TOKENS)
            assert len(tokens) == STREAM_TOKENS and tokens[:num_clear] == reference[:num_clear]
            moves = final.breakdown.migration_history
            waited_on_rank0 += any(m.from_worker == rank0_id and m.tokens_streamed == 1 for m in moves)
        assert waited_on_rank0 >= 1, "no stream was waiting for its seat on rank 0: the case was not reached"
    finally:
        deployment.close()


def _restarting_group(checkpoints, etcd_url: str, name: str, decode_fields: dict) -> tuple:
    """(transformers' model, a deployment of 1 prefill and 1 DP 2 + EP decode worker whose
    supervisor restarts what dies, the decode group's rank-1 process id)."""
    path, hf_model = checkpoints("deepseek_v3")
    deployment = Deployment(
        str(path),
        etcd_url,
        prefill=1,
        decode=1,
        model_name=f"{MODEL}-{name}",
        disaggregation="always",
        decode_fields=decode_fields,
        restart=RestartPolicy(min_backoff_s=0.2),
    )
    try:
        (rank,) = rank_children([deployment.worker("decode").process.pid], "pdserve.worker.data_parallel")
    except BaseException:
        deployment.close()
        raise
    return hf_model, deployment, rank


def _prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (14, 22, 31, 9)]


def _streams_across_a_kill(deployment: Deployment, prompts: list[list[int]], pid: int, after_responses: int) -> list:
    """Stream ``STREAM_TOKENS`` greedy tokens for every prompt at once; SIGKILL ``pid`` once each
    stream has had ``after_responses`` responses. Each stream's (tokens, final), None for a
    stream that did not end."""
    under_way = threading.Barrier(len(prompts) + 1)
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        request = inference_pb2.GenerateRequest(
            model=deployment.model_name,
            token_ids=inference_pb2.TokenIds(ids=prompts[i]),
            sampling=inference_pb2.SamplingOptions(max_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True),
        )
        tokens, final = [], None
        for n, response in enumerate(deployment.stub.Generate(request, timeout=120), start=1):
            tokens += response.token_ids
            if n == after_responses:
                under_way.wait(60)
            if response.HasField("final"):
                final = response.final
        results[i] = (tokens, final)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    under_way.wait(90)
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(130)
    return results


def test_tensor_parallel_ranks_inside_each_data_parallel_rank_serve_and_fail_together(checkpoints, etcd_url):
    """DP 2 x TP 2 on each side (4 ranks a worker, the experts over all 4): every DP rank is a
    worker whose TP ranks pull their own KV; greedy tokens equal transformers'. Killing one TP
    rank of the decode group takes the whole group down."""
    path, hf_model = checkpoints("deepseek_v3")
    both = {"parallel": ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)}
    deployment = Deployment(
        str(path),
        etcd_url,
        prefill=1,
        decode=1,
        model_name=f"{MODEL}-tp-inside",
        disaggregation="always",
        prefill_fields=both,
        decode_fields=both,
    )
    try:
        workers = deployment.registered()
        assert sorted(w.role for w in workers) == ["decode", "decode", "prefill", "prefill"]
        assert all(w.tensor_parallel_size == 2 and w.group_size == 2 for w in workers), workers
        generator = torch.Generator().manual_seed(12)
        prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (9, 17, 33, 24, 12, 28)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(lambda p: deployment.generate(p, max_tokens=8, temperature=0, ignore_eos=True), prompts)
            )
        for prompt, result in zip(prompts, results):
            reference, num_clear = reference_greedy(hf_model, prompt, 8)
            assert result["token_ids"][:num_clear] == reference[:num_clear], prompt
            assert result["final"].breakdown.disaggregated
        served = {r["final"].breakdown.decode_worker for r in results}
        assert len(served) == 2, served  # both decode DP ranks, each a TP group, decoded
        deployment.wait_registered(_idle, 15, "every block free again on every rank")

        worker = deployment.worker("decode")
        followers = rank_children([worker.process.pid], "pdserve.worker.data_parallel")
        assert len(followers) == 3, followers  # DP rank 0's TP rank 1, and DP rank 1's two ranks
        os.kill(followers[-1], signal.SIGKILL)
        deployment.wait_registered(
            lambda ws: sorted(w.role for w in ws) == ["prefill", "prefill"], 60, "both decode ranks gone"
        )
        assert deployment.run(worker.process.wait(), timeout=60) == 1
    finally:
        deployment.close()
