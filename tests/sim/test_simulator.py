"""The simulator: deterministic replays, latency that follows load, replicas that take time,
and the planner against a fixed pool."""

import pytest

from pdserve.discovery.knobs import Knobs
from pdserve.discovery.slo import SLOTargets
from pdserve.planner.planner import Planner
from sim.cluster import Cluster, ClusterConfig
from sim.simulator import simulate
from sim.traces import Trace, TraceRequest, burst, length_shift, steady, step
from tests.planner.profiles import synthetic_profile

SLO = SLOTargets(model="m", ttft_p90_s=0.3, itl_p90_s=0.03, max_prefill_replicas=8, max_decode_replicas=8)


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values)


def test_a_seeded_replay_is_deterministic():
    trace = steady(10.0, 256, 64, 120.0)
    runs = [simulate(synthetic_profile(), trace, SLO, None, prefill=1, decode=2, seed=3) for _ in range(2)]
    assert runs[0].intervals == runs[1].intervals
    other = simulate(synthetic_profile(), trace, SLO, None, prefill=1, decode=2, seed=4)
    assert other.intervals != runs[0].intervals


def test_more_load_means_more_latency():
    profile = synthetic_profile()
    light, heavy = (
        simulate(profile, steady(rate, 256, 64, 300.0), SLO, None, prefill=2, decode=2) for rate in (10.0, 40.0)
    )
    assert mean(r.ttft_p90_s for r in heavy.intervals) > mean(r.ttft_p90_s for r in light.intervals)
    assert mean(r.itl_p90_s for r in heavy.intervals) > mean(r.itl_p90_s for r in light.intervals)
    assert heavy.gpu_intervals(0) == light.gpu_intervals(0) == 4 * 30


def test_a_replica_of_several_ranks_holds_that_many_gpus():
    trace = steady(10.0, 256, 64, 300.0)
    groups = ClusterConfig(prefill_ranks=2, decode_ranks=4)  # prefill TP 2, decode DP 4 + EP
    result = simulate(synthetic_profile(), trace, SLO, None, prefill=2, decode=1, config=groups)
    assert result.gpu_intervals(0) == (2 * 2 + 1 * 4) * 30


def test_replicas_become_ready_after_startup_and_drain_before_leaving():
    cluster = Cluster(synthetic_profile(), ClusterConfig(startup_s=30.0), Knobs(), prefill=1, decode=1)
    cluster.scale(2, 1)
    cluster.run_until(10.0)
    cluster.scale(3, 1)  # one more while one is starting: the starting one stays
    assert sum(w.gone_s is None for w in cluster.prefill_workers) == 3
    cluster.run_until(29.0)
    assert cluster.ready_count() == (1, 1)
    cluster.run_until(31.0)
    assert cluster.ready_count() == (2, 1)
    cluster.run_until(41.0)
    assert cluster.ready_count() == (3, 1)
    for k in range(20):  # long outputs keep the decode worker busy
        cluster.run_until(41.0 + k * 0.01)
        cluster.arrive(TraceRequest(cluster.now, 64, 500))
    cluster.run_until(43.0)
    cluster.scale(3, 2)
    cluster.scale(3, 1)  # the starting replica is removed at once
    assert sum(w.gone_s is None for w in cluster.decode_workers) == 1
    cluster.scale(3, 0)  # the busy one drains: still there, but takes nothing new
    (busy,) = [w for w in cluster.decode_workers if w.gone_s is None]
    assert busy.draining and busy.num_decoding > 0
    cluster.run_until(70.0)
    assert busy.gone_s is not None and len(cluster.samples.e2e) == 20


@pytest.mark.slow
def test_planner_beats_an_undersized_fixed_pool():
    profile = synthetic_profile()
    trace = step(15.0, 256, 64, 600.0)
    fixed = simulate(profile, trace, SLO, None, prefill=1, decode=1)
    planner = Planner(SLO, profile, prefill_replicas=1, decode_replicas=1)
    planned = simulate(profile, trace, SLO, planner, prefill=1, decode=1)
    assert planned.attainment(6) >= 0.85
    assert planned.attainment(6) > fixed.attainment(6) + 0.2
    assert planned.decisions and max(d.decode_replicas for d in planned.decisions) > 1


def test_trace_shapes():
    def rate(trace: Trace, start: float, end: float) -> float:
        return sum(start <= r.arrival_s < end for r in trace.requests()) / (end - start)

    stepped = step(10.0, 256, 64, 900.0)
    assert rate(stepped, 0, 300) == pytest.approx(10.0, rel=0.15)
    assert rate(stepped, 300, 600) == pytest.approx(30.0, rel=0.15)
    spiky = burst(10.0, 256, 64, 900.0, factor=3.0, burst_s=20.0, every_s=100.0)
    assert spiky.duration_s == pytest.approx(900.0)
    assert rate(spiky, 300, 320) == pytest.approx(30.0, rel=0.3) and rate(spiky, 320, 400) < 15.0
    shifted = length_shift(10.0, 256, 64, 900.0)

    def median_prompt(start: float, end: float) -> float:
        lengths = sorted(r.prompt_tokens for r in shifted.requests() if start <= r.arrival_s < end)
        return lengths[len(lengths) // 2]

    assert median_prompt(300, 600) == pytest.approx(3 * median_prompt(0, 300), rel=0.2)
