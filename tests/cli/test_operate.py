"""The operators' commands as an operator runs them: real processes against a real etcd.

``slo``, ``workers``, ``status`` and ``drain`` read what workers, frontends and the planner
really write (``WorkerRegistration`` under a lease, ``FrontendStats``, the planner's
``Decision`` JSON); each test keeps to a model name of its own in the session's etcd.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest

from pdserve.discovery.etcd import EtcdConnection, close_quietly, connect
from pdserve.discovery.registration import WorkerRegistration
from pdserve.discovery.registry import WorkerEntry, frontend_key, list_workers, planner_key
from pdserve.observability.frontend_stats import RollingWindow
from pdserve.types.engine_load import EngineLoad
from tests.utils.aio import run_scenario


def pdserve(*args: str, etcd: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m pdserve ARGS [--etcd URL]`` with no $PDSERVE_ETCD inherited."""
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_ETCD"}
    argv = [sys.executable, "-m", "pdserve", *args, *(["--etcd", etcd] if etcd else [])]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


async def pdserve_async(*args: str, etcd: str) -> subprocess.CompletedProcess:
    """``pdserve`` from a test's event loop, which meanwhile keeps registrations alive."""
    return await asyncio.to_thread(pdserve, *args, etcd=etcd)


def make_entry(model: str, worker_id: str, role: str, endpoint: str = "127.0.0.1:50051") -> WorkerEntry:
    return WorkerEntry(
        worker_id=worker_id,
        role=role,
        model=model,
        model_path="/models/tiny",
        endpoint=endpoint,
        nixl=b"\x00nixl",
        block_size=16,
        num_kv_blocks=100,
        max_model_len=2048,
        vocab_size=320,
        max_num_seqs=64,
        started_at=time.time() - 75,
    )


@asynccontextmanager
async def registered(etcd_url: str, *entries: WorkerEntry) -> AsyncIterator[None]:
    """The entries registered, each with the load and draining state it carries."""
    etcd = EtcdConnection(etcd_url)
    registrations = [
        WorkerRegistration(etcd, entry, lambda e=entry: e.load, draining=lambda e=entry: e.draining, ttl_s=5)
        for entry in entries
    ]
    try:
        for registration in registrations:
            await registration.start()
        yield
    finally:
        for registration in registrations:
            await registration.close()
        await etcd.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_slo_set_then_show_round_trips(etcd_url: str, model: str) -> None:
    stored = pdserve("slo", "set", "--model", model, "--ttft-p90", "500ms", "--itl-p90", "0.03s", etcd=etcd_url)
    assert stored.returncode == 0, stored.stderr
    assert model in stored.stdout and "500ms" in stored.stdout and "30ms" in stored.stdout

    # Flags not given keep their stored values.
    changed = pdserve("slo", "set", "--model", model, "--max-decode", "16", "--e2e-p90", "20s", "--json", etcd=etcd_url)
    assert changed.returncode == 0, changed.stderr
    expected = {
        "model": model,
        "ttft_p90_s": 0.5,
        "itl_p90_s": 0.03,
        "e2e_p90_s": 20.0,
        "min_prefill_replicas": 1,
        "max_prefill_replicas": 8,
        "min_decode_replicas": 1,
        "max_decode_replicas": 16,
    }
    assert json.loads(changed.stdout) == expected

    one = pdserve("slo", "show", "--model", model, "--json", etcd=etcd_url)
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout) == expected
    every = pdserve("slo", "show", "--json", etcd=etcd_url)
    assert expected in json.loads(every.stdout)
    shown = pdserve("slo", "show", "--model", model, etcd=etcd_url)
    header, row = shown.stdout.splitlines()
    assert header.split() == ["MODEL", "TTFT_P90", "ITL_P90", "E2E_P90", "PREFILL", "DECODE"]
    assert row.split() == [model, "500ms", "30ms", "20s", "1..8", "1..16"]

    cleared = pdserve("slo", "set", "--model", model, "--e2e-p90", "none", "--json", etcd=etcd_url)
    assert json.loads(cleared.stdout)["e2e_p90_s"] is None
    assert pdserve("slo", "delete", "--model", model, etcd=etcd_url).returncode == 0
    missing = pdserve("slo", "show", "--model", model, etcd=etcd_url)
    assert missing.returncode == 1 and f"no SLO for model {model!r}" in missing.stderr


def test_slo_set_refuses_bad_input_with_a_clear_line(etcd_url: str, model: str) -> None:
    bad = pdserve("slo", "set", "--model", model, "--ttft-p90", "fast", "--itl-p90", "30ms", etcd=etcd_url)
    assert bad.returncode == 2
    assert "argument --ttft-p90: duration 'fast' is not a number" in bad.stderr
    assert "Traceback" not in bad.stderr

    incomplete = pdserve("slo", "set", "--model", model, "--itl-p90", "30ms", etcd=etcd_url)
    assert incomplete.returncode == 2
    assert f"model {model!r} has no targets yet: --ttft-p90 required" in incomplete.stderr

    bounds = pdserve(
        "slo",
        "set",
        "--model",
        model,
        "--ttft-p90",
        "1s",
        "--itl-p90",
        "30ms",
        "--min-decode",
        "4",
        "--max-decode",
        "2",
        etcd=etcd_url,
    )
    assert bounds.returncode == 2 and "max_decode_replicas (2) must be >= min_decode_replicas (4)" in bounds.stderr
    assert pdserve("slo", "show", "--model", model, etcd=etcd_url).returncode == 1  # nothing was stored

    no_etcd = pdserve("slo", "show")
    assert no_etcd.returncode == 2 and "--etcd is required (or set PDSERVE_ETCD)" in no_etcd.stderr


def test_workers_json_lists_a_live_registration(etcd_url: str, model: str) -> None:
    prefill = make_entry(model, f"prefill-{model[-8:]}", "prefill", "10.0.0.1:7001")
    decode = make_entry(model, f"decode-{model[-8:]}", "decode", "10.0.0.2:7002")
    busy = EngineLoad(running=3, waiting=2, kv_blocks_used=25, kv_blocks_total=100, held_requests=4)

    async def scenario() -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
        workers = [
            msgspec.structs.replace(prefill, load=busy),
            msgspec.structs.replace(decode, draining=True, group_id=decode.worker_id, group_size=2),
        ]
        async with registered(etcd_url, *workers):
            as_json = await pdserve_async("workers", "--model", model, "--json", etcd=etcd_url)
            as_table = await pdserve_async("workers", "--model", model, etcd=etcd_url)
        return as_json, as_table

    as_json, as_table = run_scenario(scenario())
    assert as_json.returncode == 0, as_json.stderr
    workers = json.loads(as_json.stdout)
    assert [(w["role"], w["worker_id"], w["endpoint"]) for w in workers] == [
        ("prefill", prefill.worker_id, "10.0.0.1:7001"),
        ("decode", decode.worker_id, "10.0.0.2:7002"),
    ]
    first = workers[0]
    assert first["model"] == model and "nixl" not in first
    assert first["load"]["running"] == 3 and first["load"]["waiting"] == 2 and first["load"]["held_requests"] == 4
    assert first["load"]["kv_usage"] == pytest.approx(0.25)
    assert 0 < first["lease_ttl_s"] <= first["lease_granted_ttl_s"] == 5
    assert first["uptime_s"] == pytest.approx(75, abs=30)
    assert workers[1]["draining"] is True
    assert (first["group_id"], first["group_size"]) == ("", 1)
    assert (workers[1]["group_id"], workers[1]["group_size"], workers[1]["group_rank"]) == (decode.worker_id, 2, 0)

    lines = as_table.stdout.splitlines()
    assert lines[0].split() == [
        "ROLE",
        "WORKER",
        "ENDPOINT",
        "MODEL",
        "RUN",
        "WAIT",
        "KV",
        "HELD",
        "STATE",
        "UP",
        "LEASE",
        "GROUP",
    ]
    assert lines[1].split()[:9] == ["prefill", prefill.worker_id, "10.0.0.1:7001", model, "3", "2", "25%", "4", "ready"]
    assert lines[2].split()[:9] == ["decode", decode.worker_id, "10.0.0.2:7002", model, "0", "0", "0%", "-", "draining"]
    assert lines[1].split()[-1] == "-" and lines[2].split()[-1] == f"{decode.worker_id}[0/2]"


def test_status_shows_pools_latency_against_the_slo_and_the_planners_reasons(etcd_url: str, model: str) -> None:
    frontend_id = f"frontend-{uuid.uuid4().hex[:8]}"
    window = RollingWindow(60.0)
    now = time.time()
    for i in range(20):  # TTFT 100..290 ms (p50 190 ms, p90 270 ms); ITL 40 ms (p90 over a 30 ms target)
        window.record(
            model, now - 5, ttft_s=0.1 + i / 100, itl_s=[0.04] * 9, e2e_s=1.0, prompt_tokens=100, output_tokens=10
        )
    # The planner's published Decision, as JSON (status reads it field by field).
    decision = msgspec.json.encode(
        {
            "model": model,
            "time": now - 12,
            "prefill_replicas": 1,
            "decode_replicas": 3,
            "knobs": {
                "decode_max_num_seqs": 64,
                "decode_max_num_batched_tokens": 2048,
                "prefill_chunk_size": 2048,
                "local_prefill_threshold_tokens": 0,
            },
            "reasons": ["predicted ITL p90 41ms > target 30ms at 2.0 req/s peak, 1.5 mean: decode 2→3"],
            "rate": 1.5,
            "peak_rate": 2.0,
            "predicted_ttft_p90_s": 0.2,
            "predicted_itl_p90_s": 0.025,
        }
    )
    prefill = make_entry(model, f"prefill-{model[-8:]}", "prefill")
    decodes = [make_entry(model, f"decode-{i}-{model[-8:]}", "decode") for i in range(2)]
    load = EngineLoad(running=5, waiting=1, kv_blocks_used=50, kv_blocks_total=100)

    async def scenario() -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
        client = await connect(etcd_url)
        try:
            await client.put(frontend_key(frontend_id).encode(), window.snapshot(frontend_id).encode())
            await client.put(planner_key(model).encode(), decision)
            workers = [msgspec.structs.replace(e, load=load) for e in (prefill, decodes[0])]
            workers.append(msgspec.structs.replace(decodes[1], draining=True))
            async with registered(etcd_url, *workers):
                as_json = await pdserve_async("status", "--model", model, "--json", etcd=etcd_url)
                as_table = await pdserve_async("status", "--model", model, etcd=etcd_url)
        finally:
            await client.delete(frontend_key(frontend_id).encode())
            await client.delete(planner_key(model).encode())
            await close_quietly(client)
        return as_json, as_table

    assert (
        pdserve("slo", "set", "--model", model, "--ttft-p90", "500ms", "--itl-p90", "30ms", etcd=etcd_url).returncode
        == 0
    )
    as_json, as_table = run_scenario(scenario())
    assert as_json.returncode == 0, as_json.stderr
    [status] = json.loads(as_json.stdout)["models"]
    assert status["model"] == model
    assert status["slo"]["ttft_p90_s"] == 0.5 and status["slo"]["itl_p90_s"] == 0.03
    prefill_pool, decode_pool = status["pools"]["prefill"], status["pools"]["decode"]
    assert (prefill_pool["ready"], prefill_pool["draining"], prefill_pool["running"]) == (1, 0, 5)
    assert (decode_pool["ready"], decode_pool["draining"], decode_pool["running"], decode_pool["waiting"]) == (
        1,
        1,
        5,
        1,
    )
    assert decode_pool["kv_usage"] == pytest.approx(0.5)  # the draining worker reported no blocks
    latency = status["latency"]
    assert latency["num_requests"] == 20 and latency["num_frontends"] == 1
    assert latency["ttft_p90_ms"] == pytest.approx(270) and latency["itl_p90_ms"] == pytest.approx(40)
    assert status["checks"] == {"ttft_p90": "OK", "itl_p90": "BREACH", "e2e_p90": None}
    assert status["planner"]["decode_replicas"] == 3
    assert status["planner"]["reasons"] == msgspec.json.decode(decision)["reasons"]
    assert status["knobs"]["source"] == "start-up" and status["knobs"]["decode_max_num_seqs"] == 64

    text = as_table.stdout
    assert as_table.returncode == 0, as_table.stderr
    assert f"MODEL {model}" in text
    assert any(line.split()[:2] == ["ITL", "40ms"] and line.split()[-1] == "BREACH" for line in text.splitlines())
    assert any(
        line.split()[:3] == ["TTFT", "190ms", "270ms"] and line.split()[-1] == "OK" for line in text.splitlines()
    )
    assert re.search(r"planner \(\d+s ago\): prefill 1, decode 3", text), text
    assert msgspec.json.decode(decision)["reasons"][0] in text
    assert "knobs in force (start-up settings): decode_max_num_seqs=64" in text


def test_drain_of_an_unknown_worker_names_the_known_ones(etcd_url: str, model: str) -> None:
    worker = make_entry(model, f"decode-{model[-8:]}", "decode")

    async def scenario() -> subprocess.CompletedProcess:
        async with registered(etcd_url, worker):
            return await pdserve_async("drain", "no-such-worker", etcd=etcd_url)

    result = run_scenario(scenario())
    assert result.returncode == 1
    assert f"no worker 'no-such-worker' in the registry at {etcd_url}" in result.stderr
    assert worker.worker_id in result.stderr


@pytest.fixture(scope="module")
def time_limit_s() -> float:
    """How fast a command must fail: 6 s, or Python's start-up plus 4 s where start-up alone
    is slow (``import pdserve`` imports torch, seconds on a loaded machine)."""
    start = time.monotonic()
    assert pdserve("--help").returncode == 0
    return max(6.0, time.monotonic() - start + 4.0)


@pytest.mark.parametrize("command", [["slo", "show"], ["status"], ["workers", "--json"], ["drain", "w-1"]])
def test_unreachable_etcd_fails_fast_naming_the_endpoint(command: list[str], time_limit_s: float) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    result = pdserve(*command, etcd=url, timeout=30)
    assert time.monotonic() - start < time_limit_s
    assert result.returncode == 1
    assert f"error: etcd at {url} is unreachable" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_an_etcd_that_never_answers_fails_at_the_deadline(time_limit_s: float) -> None:
    with socket.socket() as silent:  # accepts TCP connections, never speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        result = pdserve("status", "--watch", etcd=url, timeout=30)
        assert time.monotonic() - start < time_limit_s
    assert result.returncode == 1 and f"error: etcd at {url} is unreachable" in result.stderr


@pytest.mark.slow
def test_drain_stops_a_real_decode_worker(etcd_url: str, model: str, checkpoints) -> None:
    path, _ = checkpoints("llama")
    worker_id = f"decode-{model[-8:]}"
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_ETCD"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve",
            "decode",
            "--model",
            str(path),
            "--model-name",
            model,
            "--etcd",
            etcd_url,
            "--worker-id",
            worker_id,
            "--num-threads",
            "1",
            "--kv-cache-memory",
            "16M",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        async def wait_registered() -> None:
            client = await connect(etcd_url)
            try:
                deadline = time.monotonic() + 60
                while not any(w.worker_id == worker_id for w in await list_workers(client)):
                    assert process.poll() is None, f"the worker exited: {process.stderr.read()}"
                    assert time.monotonic() < deadline, "the worker did not register within 60 s"
                    await asyncio.sleep(0.2)
            finally:
                await close_quietly(client)

        run_scenario(wait_registered())
        result = pdserve("drain", worker_id, "--wait", "--timeout", "30s", "--json", etcd=etcd_url)
        assert result.returncode == 0, result.stderr
        outcome = json.loads(result.stdout)
        assert outcome["worker_id"] == worker_id and outcome["in_flight"] == 0 and outcome["left_registry"] is True
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
