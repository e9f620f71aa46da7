"""Prometheus metrics as a scraper sees them: served over HTTP from each process's own registry."""

from __future__ import annotations

import urllib.request

from pdserve.observability.metrics import FrontendMetrics, WorkerMetrics, serve_metrics
from pdserve.types.engine_load import EngineLoad


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_worker_metrics_read_occupancy_at_scrape_time_and_count_requests():
    load = EngineLoad(running=3, waiting=1, kv_blocks_used=10, kv_blocks_total=64, held_requests=2, num_preemptions=5)
    metrics = WorkerMetrics("decode", "decode-x", "tiny", lambda: load)
    metrics.prompt_admitted(100, 25)
    metrics.kv_transfer_bytes.inc(4096)
    metrics.kv_transfer_seconds.observe(0.004)
    metrics.request_ended("length")
    text = _scrape(serve_metrics(metrics.registry, "127.0.0.1", 0))
    labels = 'model="tiny",role="decode",worker="decode-x"'
    for line in (
        f"pdserve_running_requests{{{labels}}} 3.0",
        f"pdserve_kv_blocks_free{{{labels}}} 54.0",
        f"pdserve_held_requests{{{labels}}} 2.0",
        f"pdserve_preemptions_total{{{labels}}} 5.0",
        f"pdserve_prefix_cache_hit_rate{{{labels}}} 0.25",
        f"pdserve_kv_transfer_bytes_total{{{labels}}} 4096.0",
        f"pdserve_kv_transfer_seconds_count{{{labels}}} 1.0",
    ):
        assert line in text, line
    [ended] = [line for line in text.splitlines() if line.startswith("pdserve_worker_requests_total{")]
    assert 'outcome="length"' in ended and ended.endswith(" 1.0")
    assert "pdserve_gpu_utilization" not in text  # no GPU here: absent, not an error


def test_frontend_metrics_histograms_and_queue_length():
    metrics = FrontendMetrics(lambda: 7)
    metrics.ttft_seconds.labels("tiny").observe(0.2)
    metrics.itl_seconds.labels("tiny").observe(0.01)
    metrics.requests.labels("tiny", "OK").inc()
    text = _scrape(serve_metrics(metrics.registry, "127.0.0.1", 0))
    assert 'pdserve_ttft_seconds_bucket{le="0.25",model="tiny"} 1.0' in text
    assert 'pdserve_itl_seconds_count{model="tiny"} 1.0' in text
    assert 'pdserve_requests_total{code="OK",model="tiny"} 1.0' in text
    assert "pdserve_queue_length 7.0" in text
