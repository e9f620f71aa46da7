"""``pdserve top``: its frame rendered from hand-made snapshots, and its sources read from a
real etcd, a real frontend metrics server and a worker whose /metrics never answers."""

from __future__ import annotations

import socket
import time
import uuid

import msgspec

from pdserve.cli.top_sources import Sources
from pdserve.cli.top_view import ModelView, Snapshot, WorkerRow, render
from pdserve.discovery.etcd import EtcdConnection, close_quietly, connect
from pdserve.discovery.knobs import Knobs
from pdserve.discovery.registry import Role, frontend_key
from pdserve.discovery.slo import SLOTargets
from pdserve.observability.frontend_stats import RollingWindow
from pdserve.observability.metrics import FrontendMetrics
from pdserve.observability.probes import MetricsServer
from pdserve.types.engine_load import EngineLoad
from tests.cli.test_operate import make_entry, pdserve, registered
from tests.utils.aio import run_scenario

KNOBS = Knobs(
    decode_max_num_seqs=64,
    decode_max_num_batched_tokens=2048,
    prefill_chunk_size=512,
    local_prefill_threshold_tokens=0,
)
LATENCY = {
    "num_requests": 20,
    "window_s": 10.0,
    "arrival_rate": 2.0,
    "num_errors": 1,
    "ttft_p50_ms": 190.0,
    "ttft_p90_ms": 270.0,
    "itl_p50_ms": 40.0,
    "itl_p90_ms": 41.0,
    "e2e_p90_ms": 1000.0,
}


def snapshot(**changes: object) -> Snapshot:
    model = ModelView(
        model="org/m",
        workers=[
            WorkerRow("prefill-a", Role.PREFILL, running=1, waiting=3, kv_usage=0.25, draining=False, held_requests=2),
            WorkerRow("decode-a", Role.DECODE, 7, 0, 0.5, draining=False, prefix_hit_rate=0.125, num_preemptions=4),
            WorkerRow("decode-b", Role.DECODE, 0, 0, None, draining=True),
        ],
        slo=SLOTargets(model="org/m", ttft_p90_s=0.5, itl_p90_s=0.03),
        latency=LATENCY,
        knobs=KNOBS,
        knobs_source="stored",
        migrations_total=5,
        migrations_recent=2,
    )
    fields = {"etcd": "http://127.0.0.1:2379", "time": 0.0, "frame": 7, "interval_s": 1.0, "models": [model]}
    return Snapshot(**{**fields, "num_frontends": 1, **changes})  # type: ignore[arg-type]


def line_with(lines: list[str], *words: str) -> str:
    found = [line for line in lines if all(word in line for word in words)]
    assert len(found) == 1, f"{words} in {len(found)} lines of:\n" + "\n".join(lines)
    return found[0]


def test_a_frame_shows_both_pools_their_workers_and_who_drains() -> None:
    lines = render(snapshot())
    assert "frame 7" in lines[0] and "every 1000ms" not in lines[0] and "every 1s" in lines[0]
    assert line_with(lines, "PREFILL pool").strip() == "PREFILL pool: 1 ready, 0 draining, bounds 1..8"
    assert "DECODE pool: 1 ready, 1 draining" in line_with(lines, "DECODE pool")
    assert line_with(lines, "prefill-a").split() == ["prefill-a", "1", "3", "25%", "2", "?", "?", "ready"]
    assert line_with(lines, "decode-a").split() == ["decode-a", "7", "0", "50%", "-", "12%", "4", "ready"]
    assert line_with(lines, "decode-b").split() == ["decode-b", "0", "0", "?", "-", "?", "?", "draining"]
    # Rows sit under their pool's line.
    assert lines.index(line_with(lines, "PREFILL pool")) < lines.index(line_with(lines, "prefill-a"))
    assert lines.index(line_with(lines, "DECODE pool")) < lines.index(line_with(lines, "decode-a"))


def test_latency_is_judged_against_the_slo_p90() -> None:
    lines = render(snapshot())
    assert line_with(lines, "TTFT ").split() == ["TTFT", "190ms", "270ms", "500ms", "OK"]
    assert line_with(lines, "ITL ").split() == ["ITL", "40ms", "41ms", "30ms", "BREACH"]
    assert line_with(lines, "E2E ").split() == ["E2E", "-", "1.00s", "-", "-"]  # no e2e target
    assert "20 requests in the last 10s (2.00 req/s), 1 errors" in line_with(lines, "traffic:")


def test_knobs_and_migrations_are_shown() -> None:
    lines = render(snapshot())
    assert line_with(lines, "knobs").strip() == (
        "knobs (stored): decode_max_num_seqs=64, decode_max_num_batched_tokens=2048, "
        "prefill_chunk_size=512, local_prefill_threshold_tokens=0"
    )
    assert line_with(lines, "migrations").strip() == "migrations: 5 in all, +2 since the last frame"
    unknown = snapshot(models=[ModelView("org/m", migrations_total=None)])
    assert line_with(render(unknown), "migrations").strip() == "migrations: ? in all"


def test_a_source_that_does_not_answer_is_named_and_the_rest_still_shows() -> None:
    lines = render(snapshot(unanswered={"metrics 10.0.0.9:9100": "no answer within 1s"}, etcd_age_s=12.0))
    assert lines[-2:] == ["NO ANSWER", "  metrics 10.0.0.9:9100: no answer within 1s"]
    assert "registry data from 12s ago" in lines[1]
    assert line_with(lines, "decode-a")  # the frame is whole


def test_a_frame_without_models_says_so_and_lines_fit_the_width() -> None:
    lines = render(snapshot(models=[], num_frontends=0), width=40)
    assert "no models" in lines[-1]
    assert all(len(line) <= 40 for line in lines)
    assert "q to quit" in render(snapshot(), interactive=True)[0]
    assert "q to quit" not in render(snapshot())[0]


def test_sources_read_etcd_and_metrics_and_name_a_silent_one(etcd_url: str, model: str) -> None:
    metrics = FrontendMetrics(in_flight=lambda: 0)
    server = MetricsServer.start(metrics.registry, "127.0.0.1", 0)
    frontend_id = f"frontend-{uuid.uuid4().hex[:8]}"
    window = RollingWindow(60.0)
    window.record(model, time.time() - 1, ttft_s=0.2, itl_s=[0.02] * 3, e2e_s=0.3, prompt_tokens=8, output_tokens=4)
    stats = msgspec.structs.replace(window.snapshot(frontend_id), metrics_endpoint=f"127.0.0.1:{server.port}")
    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    prefill = make_entry(model, f"prefill-{model[-8:]}", "prefill")
    decode = msgspec.structs.replace(
        make_entry(model, f"decode-{model[-8:]}", "decode"),
        metrics_port=silent.getsockname()[1],
        load=EngineLoad(running=3, waiting=1, kv_blocks_used=10, kv_blocks_total=40),
        draining=True,
    )

    async def scenario() -> tuple[Snapshot, Snapshot, float]:
        client = await connect(etcd_url)
        etcd = EtcdConnection(etcd_url, 0.5)
        try:
            await client.put(frontend_key(frontend_id).encode(), stats.encode())
            async with registered(etcd_url, prefill, decode):
                sources = Sources(etcd, 0.5, 1.0, model)
                metrics.migrations.labels(model).inc(3)
                first = await sources.read()
                metrics.migrations.labels(model).inc(2)
                start = time.monotonic()
                second = await sources.read()
                took = time.monotonic() - start
        finally:
            await client.delete(frontend_key(frontend_id).encode())
            await close_quietly(client)
            await etcd.close()
        return first, second, took

    try:
        first, second, took = run_scenario(scenario())
    finally:
        server.close()
        silent.close()
    assert took < 2.0  # the silent worker costs one deadline, not a hang
    (view,) = second.models
    assert (first.models[0].migrations_total, first.models[0].migrations_recent) == (3, None)
    assert (view.migrations_total, view.migrations_recent) == (5, 2)
    assert [(w.role, w.running, w.waiting, w.kv_usage, w.draining) for w in view.workers] == [
        (Role.PREFILL, 0, 0, None, False),
        (Role.DECODE, 3, 1, 0.25, True),
    ]
    assert view.workers[1].num_preemptions is None  # its /metrics did not answer
    assert second.unanswered == {f"metrics 127.0.0.1:{decode.metrics_port}": "no answer within 0.5s"}
    assert view.latency is not None and view.latency["ttft_p90_ms"] == 200.0
    assert view.knobs is not None and view.knobs_source == "start-up"
    assert (first.frame, second.frame) == (1, 2)


def test_top_once_prints_one_frame(etcd_url: str, model: str) -> None:
    result = pdserve("top", "--once", "--model", model, etcd=etcd_url)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"pdserve top · etcd {etcd_url} · ")
    assert "no models" in result.stdout and "\x1b" not in result.stdout
