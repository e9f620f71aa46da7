"""observe(): one Observation from the frontends' published stats and the workers' loads."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.discovery.knobs import Knobs
from pdserve.observability.frontend_stats import FrontendStats, ModelStats
from pdserve.planner.observer import observe
from pdserve.types.engine_load import EngineLoad
from tests.discovery.test_registry import make_entry


def stats(**fields) -> ModelStats:
    return ModelStats(window_s=10, num_requests=fields.pop("num_requests", 10), arrival_rate=1.0, **fields)


def worker(worker_id: str, role: str, draining: bool = False, **load):
    return msgspec.structs.replace(make_entry("m", worker_id, role), load=EngineLoad(**load), draining=draining)


def test_arrivals_are_summed_by_second_over_the_complete_seconds_of_the_interval() -> None:
    # Two frontends whose snapshots were taken in different seconds; the interval is the 4
    # whole seconds 996..999 (now is 1001.3: 1000 may still be filling in a snapshot).
    a = FrontendStats(frontend_id="a", updated_at=1000.6, models={"m": stats(arrivals_per_s=[1, 2, 3, 4, 5])})
    b = FrontendStats(frontend_id="b", updated_at=999.9, models={"m": stats(arrivals_per_s=[10, 20, 30, 40])})
    obs = observe("m", [a, b], [], Knobs(), now=1001.3, interval_s=4)
    # a: 996..1000 = 1..5; b: 996..999 = 10..40.
    assert obs.arrivals_per_s == [1 + 10, 2 + 20, 3 + 30, 4 + 40]
    assert obs.interval_s == 4 and obs.time == 1001.3


def test_tails_merge_to_the_worst_and_centres_by_requests() -> None:
    a = FrontendStats(
        frontend_id="a",
        updated_at=1.0,
        models={
            "m": stats(
                num_requests=30,
                ttft_p50_ms=100,
                ttft_p90_ms=200,
                itl_p50_ms=10,
                itl_p90_ms=20,
                prompt_tokens_mean=50,
                prompt_tokens_p50=40,
                prompt_tokens_p90=90,
            )
        },
    )
    b = FrontendStats(
        frontend_id="b",
        updated_at=1.0,
        models={
            "m": stats(
                num_requests=10,
                ttft_p50_ms=300,
                ttft_p90_ms=900,
                prompt_tokens_mean=150,
                prompt_tokens_p50=140,
                prompt_tokens_p90=190,
            )
        },
    )
    other = FrontendStats(frontend_id="c", updated_at=1.0, models={"other": stats(ttft_p90_ms=10_000)})
    obs = observe("m", [a, b, other], [], Knobs(), now=2.0, interval_s=10)
    assert obs.ttft_s.p90 == pytest.approx(0.9) and obs.ttft_s.p50 == pytest.approx((30 * 0.1 + 10 * 0.3) / 40)
    assert obs.itl_s.p90 == pytest.approx(0.02) and obs.itl_s.count == 30  # only a has ITL samples
    assert obs.prompt_tokens.mean == pytest.approx((30 * 50 + 10 * 150) / 40) and obs.prompt_tokens.p90 == 190
    assert obs.e2e_s is None and obs.output_tokens is None  # no sample: None, not 0


def test_pools_count_ready_workers_of_the_model_only() -> None:
    workers = [
        worker("p1", "prefill", waiting=3),
        worker("p2", "prefill", waiting=2, draining=True),  # leaving: not ready, its queue is not ours
        worker("d1", "decode", running=4, kv_blocks_used=50, kv_blocks_total=100),
        worker("d2", "decode", running=2, kv_blocks_used=0, kv_blocks_total=100),
        msgspec.structs.replace(make_entry("other", "x", "decode"), load=EngineLoad(running=9)),
    ]
    obs = observe("m", [], workers, Knobs(decode_max_num_seqs=8), now=10.0, interval_s=10)
    assert (obs.num_prefill_ready, obs.num_decode_ready, obs.prefill_waiting) == (1, 2, 3)
    assert obs.decode_running == 3 and obs.decode_kv_usage == pytest.approx(0.25)
    assert obs.knobs.decode_max_num_seqs == 8 and obs.arrivals_per_s == [0] * 10
