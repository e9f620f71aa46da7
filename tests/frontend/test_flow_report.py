"""FlowReport: the final message's usage and breakdown, and the inter-token gaps."""

from __future__ import annotations

import time

import pytest

from pdserve.frontend.flow_report import FlowReport
from pdserve.v1 import inference_pb2, worker_pb2


def test_a_message_of_several_tokens_counts_that_many_equal_gaps() -> None:
    report = FlowReport(time.monotonic())
    report.streamed(1)
    time.sleep(0.02)
    report.streamed(1)
    time.sleep(0.04)
    report.streamed(2)  # two tokens in one message: two gaps of half the wait each
    gaps = report.token_gaps()
    assert len(gaps) == 3 and gaps[1] == gaps[2]
    assert gaps[0] >= 0.02 and gaps[1] >= 0.02  # 20 ms, then 40 ms over two tokens
    assert FlowReport(0.0).token_gaps() == []


def test_the_first_token_sets_the_ttft_once() -> None:
    report = FlowReport(time.monotonic() - 0.5)
    report.first_token()
    ttft = report.breakdown.ttft_ms
    time.sleep(0.01)
    report.first_token()
    assert report.breakdown.ttft_ms == ttft == pytest.approx(500, abs=100)


def test_a_prompt_computed_on_the_decode_worker_reports_its_figures_from_the_start() -> None:
    arrival = time.monotonic() - 0.1
    report = FlowReport(arrival)
    started = worker_pb2.DecodeStarted(queue_ms=5.0, prefill_ms=20.0, num_cached_tokens=16)
    report.decode_started(started, sent_at=arrival + 0.01)
    final = inference_pb2.GenerateResponse()
    report.finish(final, "d1", prompt_tokens=40)
    b = final.final.breakdown
    assert not b.disaggregated and (b.prefill_worker, b.decode_worker) == ("d1", "d1")
    assert b.queue_ms == pytest.approx(15.0, abs=1.0) and b.prefill_ms == 20.0
    assert b.ttft_ms == b.e2e_ms >= 100  # no token before the final message
    assert (final.final.usage.prompt_tokens, final.final.usage.cached_prompt_tokens) == (40, 16)


def test_a_prefilled_request_keeps_the_prefill_workers_figures_and_counts_its_migrations() -> None:
    arrival = time.monotonic()
    report = FlowReport(arrival)
    prefill = worker_pb2.PrefillResponse(worker_id="p1", queue_ms=2.0, prefill_ms=30.0, num_cached_tokens=8)
    report.prefilled(prefill, attempt=2, sent_at=arrival)
    started = worker_pb2.DecodeStarted(kv_transfer_ms=4.0, kv_transfer_bytes=1024, prefill_ms=99.0)
    report.decode_started(started, arrival)
    report.migrated(inference_pb2.Migration(from_worker="d1", to_worker="d2", tokens_streamed=3))
    final = inference_pb2.GenerateResponse()
    report.finish(final, "d2", prompt_tokens=40)
    b = final.final.breakdown
    assert b.disaggregated and (b.prefill_worker, b.decode_worker, b.prefill_attempts) == ("p1", "d2", 2)
    assert (b.prefill_ms, b.kv_transfer_ms, b.kv_transfer_bytes) == (30.0, 4.0, 1024)  # not the start's prefill_ms
    assert b.migrations == 1 and [m.to_worker for m in b.migration_history] == ["d2"]
    assert final.final.usage.cached_prompt_tokens == 8
