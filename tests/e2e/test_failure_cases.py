"""The failure cases other systems' bug trackers keep reporting, end to end on one deployment
(1 prefill + 2 decode workers, ``--disaggregation always``) with an etcd of its own, real NIXL:

- decode refuses a request before admitting it: the prefill worker's pin is freed at once;
- a prefill worker restarts under the same id and address: decode drops the stale NIXL peer
  and loads the new one (no stale read, no crash);
- a decode worker dies before its pull: the request migrates, the pin is let go;
- a slow peer (SIGSTOP past the transfer deadline): requests migrate or fail by their deadlines;
- etcd restarts under load: nothing fails.

Each ends with every worker's block pool whole, read from its /metrics. The tests run in order.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from pdserve import LLM, SamplingParams
from pdserve.types.engine_config import EngineConfig
from tests.e2e.deployment import Deployment, long_context_copy
from tests.e2e.prompts import shared_prefix_prompts
from tests.utils.etcd_server import EtcdServer

pytestmark = pytest.mark.slow
MODEL = "e2e-failure-cases"
HOLD_S = 30.0  # the prefill pin's deadline: "at once" is far sooner
TRANSFER_TIMEOUT_S = 4.0
DEADLINE_S = 20.0
MAX_TOKENS = 24
DECODE_KV_BLOCKS = 24  # the decode workers' caches are small: a long prompt can never fit there
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(checkpoints, tmp_path_factory):
    path = long_context_copy(checkpoints("llama")[0], tmp_path_factory.mktemp("llama"), 4096)
    reference = LLM(str(path))
    etcd = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    # A fixed id and address, as a pod that restarts keeps them; a lease that outlives the restart.
    prefill = {"worker_id": "prefill-fixed", "port": _free_port(), "lease_ttl_s": 60.0, "hold_s": HOLD_S}
    decode = {"lease_ttl_s": 10.0, "transfer_timeout_s": TRANSFER_TIMEOUT_S}
    deployment = Deployment(
        str(path),
        etcd.url,
        prefill=1,
        decode=2,
        model_name=MODEL,
        disaggregation="always",
        prefill_fields=prefill,
        decode_fields=decode,
    )
    yield deployment, reference, etcd
    deployment.close()
    etcd.close()


@pytest.fixture(scope="module")
def small_decode_cluster(checkpoints, tmp_path_factory):
    """Its own deployment: decode workers with DECODE_KV_BLOCKS blocks of KV."""
    path = long_context_copy(checkpoints("llama")[0], tmp_path_factory.mktemp("llama-small"), 4096)
    bytes_per_block = LLM(str(path)).engine.kv_cache_spec.bytes_per_block
    etcd = EtcdServer(tmp_path_factory.mktemp("etcd-small")).start()
    decode = {"engine": EngineConfig(kv_cache_memory=DECODE_KV_BLOCKS * bytes_per_block)}
    deployment = Deployment(
        str(path),
        etcd.url,
        prefill=1,
        decode=1,
        model_name=MODEL,
        disaggregation="always",
        prefill_fields={"hold_s": HOLD_S},
        decode_fields=decode,
    )
    yield deployment
    deployment.close()
    etcd.close()


def _many(deployment: Deployment, prompts: list[list[int]], spacing_s: float = 0.0, **options: Any) -> list[Any]:
    """The prompts' results (a dict, or the gRPC error's code name and details), in order."""

    def one(i: int) -> Any:
        time.sleep(spacing_s * i)
        started = time.monotonic()
        try:
            result = deployment.generate(prompts[i], timeout=DEADLINE_S, **options)
            result["seconds"] = time.monotonic() - started
            return result
        except grpc.RpcError as exc:
            return (exc.code().name, exc.details(), time.monotonic() - started)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def test_decode_refusing_before_admission_frees_the_prefill_pin_at_once(small_decode_cluster):
    deployment = small_decode_cluster
    too_long = [2 + i % 300 for i in range(DECODE_KV_BLOCKS * 16 + 40)]  # fits the prefill worker's cache, not decode's
    with pytest.raises(grpc.RpcError) as error:
        deployment.generate(too_long, timeout=DEADLINE_S, **GREEDY)
    refused_at = time.monotonic()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV blocks" in error.value.details()
    deployment.wait_whole(timeout=3.0)  # the Release came at once: not HOLD_S later
    assert time.monotonic() - refused_at < HOLD_S / 4
    ok = deployment.generate([5, 6, 7, 8], timeout=DEADLINE_S, **GREEDY)  # the deployment serves on
    assert len(ok["token_ids"]) == MAX_TOKENS


def test_a_prefill_worker_restarted_under_the_same_id_and_address_is_loaded_anew(cluster):
    deployment, reference, _ = cluster
    prompts = shared_prefix_prompts(6, seed=21)
    expected = [o.token_ids for o in reference.generate(prompts, SamplingParams(**GREEDY))]
    assert [r["token_ids"] for r in _many(deployment, prompts, **GREEDY)] == expected  # decode knows the peer now
    old = next(w for w in deployment.registered() if w.role == "prefill")
    deployment.kill(deployment.worker("prefill"), signal.SIGKILL)
    new_child = deployment.restart(deployment.worker("prefill"))
    deployment.wait_registered(
        lambda ws: any(w.role == "prefill" and w.nixl != old.nixl for w in ws), 10, "the new prefill worker's entry"
    )
    new = next(w for w in deployment.registered() if w.role == "prefill")
    assert (new.worker_id, new.endpoint) == (old.worker_id, old.endpoint)  # the same id and address
    time.sleep(1.0)  # the frontend's view catches up
    results = _many(deployment, prompts, **GREEDY)
    for result, want in zip(results, expected):
        assert isinstance(result, dict), result
        assert result["token_ids"] == want and result["final"].breakdown.migrations == 0
        assert result["seconds"] < TRANSFER_TIMEOUT_S  # no pull waited on the dead peer
    assert all(deployment.worker("decode", i).process.returncode is None for i in (0, 1)), "a decode worker crashed"
    assert new_child.process.returncode is None
    deployment.wait_whole(timeout=5.0)


def test_a_decode_worker_dead_before_its_pull_migrates_its_requests(cluster):
    deployment, reference, _ = cluster
    prompts = shared_prefix_prompts(8, seed=22)
    expected = [o.token_ids for o in reference.generate(prompts, SamplingParams(**GREEDY))]
    victim = deployment.worker("decode", 0)
    victim_suffix = f"-{victim.process.pid}"
    deployment.kill(victim, signal.SIGSTOP)  # it takes the calls but never gets to the pull
    killer = threading.Timer(2.0, deployment.kill, args=(victim, signal.SIGKILL))
    killer.start()
    results = _many(deployment, prompts, **GREEDY)
    killer.join()
    moved = 0
    for result, want in zip(results, expected):
        assert isinstance(result, dict), result
        assert result["token_ids"] == want
        b = result["final"].breakdown
        if b.migrations:
            moved += 1
            assert b.migration_history[0].from_worker.endswith(victim_suffix)
            assert b.migration_history[0].tokens_streamed == 1  # only the prefill worker's token
    assert moved, "no request was routed to the frozen worker"
    deployment.wait_whole(timeout=5.0)  # the pins of the unpulled attempts were released, not held HOLD_S
    deployment.restart(victim)


def test_a_slow_prefill_peer_ends_requests_by_their_deadlines(cluster):
    deployment, reference, _ = cluster
    prompts = shared_prefix_prompts(4, seed=23)
    prefill = deployment.worker("prefill")
    stopped_for_s = TRANSFER_TIMEOUT_S + 4.0
    deployment.kill(prefill, signal.SIGSTOP)
    resumer = threading.Timer(stopped_for_s, deployment.kill, args=(prefill, signal.SIGCONT))
    resumer.start()
    try:
        results = _many(deployment, prompts, **GREEDY)
    finally:
        resumer.join()
    for result in results:
        seconds = result["seconds"] if isinstance(result, dict) else result[2]
        assert seconds < DEADLINE_S + 2.0, result  # nothing waits past its deadline
        if not isinstance(result, dict):
            assert result[0] in ("DEADLINE_EXCEEDED", "UNAVAILABLE"), result
    deployment.wait_whole(timeout=HOLD_S + 5.0)


def test_an_etcd_restart_under_load_fails_nothing(cluster):
    deployment, reference, etcd = cluster
    deployment.wait_registered(lambda ws: sum(w.role == "decode" for w in ws) == 2, 30, "two decode workers")
    time.sleep(1.0)
    prompts = shared_prefix_prompts(16, seed=24)
    expected = [o.token_ids for o in reference.generate(prompts, SamplingParams(**GREEDY))]
    restarter = threading.Timer(1.0, etcd.restart)
    restarter.start()
    results = _many(deployment, prompts, spacing_s=0.3, **GREEDY)  # arrivals over ~5 s; etcd is down in there
    restarter.join()
    for result, want in zip(results, expected):
        assert isinstance(result, dict), result
        assert result["token_ids"] == want
    deployment.wait_registered(lambda ws: len(ws) == 3, 30, "every worker registered again")
    deployment.wait_whole(timeout=5.0)
