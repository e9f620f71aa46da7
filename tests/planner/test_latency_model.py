"""The latency model: monotone in load and size, unbounded past capacity, and in line with
the simulated cluster it stands for."""

import math

import pytest

from pdserve.discovery.knobs import Knobs
from pdserve.discovery.slo import SLOTargets
from pdserve.planner.forecast import LengthForecast
from pdserve.planner.latency_model import LatencyModel, LengthDistribution, erlang_c
from sim.simulator import simulate
from sim.traces import steady
from tests.planner.profiles import synthetic_profile

PROMPT = LengthForecast(mean=300.0, p50=256.0, p90=550.0)
OUTPUT = LengthForecast(mean=70.0, p50=64.0, p90=120.0)


def test_erlang_c():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(4, 0.0) == 0.0 and erlang_c(4, 4.0) == 1.0


def test_lognormal_lengths():
    lengths = LengthDistribution(p50=256.0, p90=550.0)
    assert lengths.fraction_below(256.0) == pytest.approx(0.5)
    assert lengths.fraction_below(550.0) == pytest.approx(0.9)
    assert lengths.fraction_below(0) == 0.0
    quantiles = lengths.quantiles()
    assert quantiles == sorted(quantiles) and quantiles[0] < 256 < quantiles[-1]


def test_ttft_falls_with_replicas_and_rises_with_load():
    model = LatencyModel(synthetic_profile())
    by_size = [model.ttft_p90(n, 60.0, PROMPT, Knobs()) for n in (2, 3, 4, 8)]
    assert by_size == sorted(by_size, reverse=True) and by_size[-1] > 0
    by_rate = [model.ttft_p90(3, rate, PROMPT, Knobs()) for rate in (10.0, 40.0, 70.0)]
    assert by_rate == sorted(by_rate)
    assert model.ttft_p90(1, 200.0, PROMPT, Knobs()) == math.inf


def test_local_prefill_takes_prompts_off_the_prefill_pool():
    model = LatencyModel(synthetic_profile())
    assert model.ttft_p90(2, 60.0, PROMPT, Knobs(local_prefill_threshold_tokens=256)) < model.ttft_p90(
        2, 60.0, PROMPT, Knobs()
    )


def test_itl_rises_with_load_and_is_unbounded_past_the_slots():
    model = LatencyModel(synthetic_profile())
    by_rate = [model.itl_p90(2, rate, PROMPT, OUTPUT, Knobs()) for rate in (5.0, 20.0, 40.0)]
    assert by_rate == sorted(by_rate)
    assert model.itl_p90(1, 40.0, PROMPT, OUTPUT, Knobs(decode_max_num_seqs=4)) == math.inf
    assert model.largest_batch_within(0.014, 300.0) < model.largest_batch_within(0.02, 300.0)


def test_prefill_prediction_agrees_with_the_simulated_cluster():
    profile = synthetic_profile()
    slo = SLOTargets(model="m", ttft_p90_s=10.0, itl_p90_s=10.0)
    result = simulate(profile, steady(50.0, 256, 64, 300.0), slo, None, prefill=2, decode=8)
    measured = sorted(r.ttft_p90_s for r in result.intervals[3:])[len(result.intervals[3:]) // 2]
    # The trace's lengths (median 256, sigma 0.6), as a forecast would see them.
    forecast = LengthForecast(mean=256 * math.exp(0.18), p50=256.0, p90=256 * math.exp(0.6 * 1.2816))
    predicted = LatencyModel(profile, wait_quantile=0.9).ttft_p90(2, 50.0, forecast, Knobs())
    assert predicted == pytest.approx(measured, rel=0.35)
