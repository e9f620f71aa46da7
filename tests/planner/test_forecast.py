"""Forecasts: rate level, bursts beyond Poisson noise, length percentiles."""

import random

import pytest

from pdserve.discovery.knobs import Knobs
from pdserve.observability.summary import Summary
from pdserve.planner.forecast import ForecastConfig, Forecaster, burst_rates, ewma
from pdserve.planner.observation import Observation


def observation(t: float, arrivals: list[int], prompts: list[int] | None = None) -> Observation:
    return Observation(
        model="m",
        time=t,
        interval_s=len(arrivals),
        arrivals_per_s=arrivals,
        prompt_tokens=Summary.of(prompts or []),
        output_tokens=None,
        ttft_s=None,
        itl_s=None,
        e2e_s=None,
        num_prefill_ready=1,
        num_decode_ready=1,
        prefill_waiting=0,
        decode_running=0.0,
        decode_kv_usage=0.0,
        knobs=Knobs(),
    )


def poisson_seconds(rng: random.Random, rate: float, seconds: int) -> list[int]:
    counts = []
    for _ in range(seconds):
        n, t = 0, rng.expovariate(rate)
        while t < 1.0:
            n, t = n + 1, t + rng.expovariate(rate)
        counts.append(n)
    return counts


def test_ewma():
    assert ewma(None, 5.0, 0.3) == 5.0
    assert ewma(10.0, 0.0, 0.25) == pytest.approx(7.5)


def test_burst_rates_ignore_noise_and_see_spikes():
    assert burst_rates([10, 12, 9, 11, 8, 10, 13, 9, 10, 11], 5, 10.0, 3.0) == []
    assert burst_rates([10, 10, 10, 10, 10, 30, 31, 29, 30, 30], 5, 10.0, 3.0) == [30.0]
    assert burst_rates([0, 0, 9], 2, 1.0, 3.0) == [9.0]  # a trailing partial bin is judged on its length


def test_steady_poisson_load_is_not_a_burst():
    rng = random.Random(0)
    forecaster = Forecaster()
    for k in range(60):
        forecast = forecaster.update(observation(10.0 * (k + 1), poisson_seconds(rng, 20.0, 10)))
    assert 18 < forecast.rate < 23
    assert forecast.peak_rate < 1.2 * 20.0


def test_a_burst_is_remembered_then_forgotten():
    rng = random.Random(1)
    forecaster = Forecaster(ForecastConfig(burst_memory_s=120.0))
    t = 0.0
    for _ in range(20):
        t += 10
        forecaster.update(observation(t, poisson_seconds(rng, 10.0, 10)))
    t += 10
    spike = poisson_seconds(rng, 10.0, 5) + poisson_seconds(rng, 40.0, 5)  # 5 s at 4x
    forecast = forecaster.update(observation(t, spike))
    assert forecast.peak_rate > 30
    for _ in range(10):  # the spike stays in memory: the rate is back, the peak is held
        t += 10
        forecast = forecaster.update(observation(t, poisson_seconds(rng, 10.0, 10)))
    assert forecast.rate < 15 and forecast.peak_rate > 30
    for _ in range(5):  # 150 s after it, past the 120 s memory
        t += 10
        forecast = forecaster.update(observation(t, poisson_seconds(rng, 10.0, 10)))
    assert forecast.peak_rate < 15


def test_rate_rises_at_once_and_falls_slowly():
    forecaster = Forecaster()
    for k in range(10):
        forecaster.update(observation(10.0 * (k + 1), [10] * 10))
    assert forecaster.update(observation(110.0, [30] * 10)).rate == pytest.approx(30.0)
    falling = [forecaster.update(observation(120.0 + 10 * k, [10] * 10)).rate for k in range(6)]
    assert falling == sorted(falling, reverse=True)
    assert falling[0] > 14 and falling[-1] < 10.5


def test_lengths_follow_a_shift_up_at_once_and_hold_through_empty_intervals():
    forecaster = Forecaster()
    for k in range(5):
        forecast = forecaster.update(observation(10.0 * (k + 1), [1] * 10, [100] * 9 + [400]))
    assert forecast.prompt_tokens.p50 == pytest.approx(100) and forecast.prompt_tokens.p90 == pytest.approx(100)
    forecast = forecaster.update(observation(60.0, [1] * 10, [300] * 10))
    assert forecast.prompt_tokens.p50 == pytest.approx(300)
    forecast = forecaster.update(observation(70.0, [0] * 10))
    assert forecast.prompt_tokens.p50 == pytest.approx(300)


def test_summary_weighted_percentiles():
    summary = Summary.of([0.01, 0.5], [99, 1])
    assert summary.count == 100 and summary.p90 == 0.01 and summary.max == 0.5
    assert summary.mean == pytest.approx((0.99 + 0.5) / 100)
    assert Summary.of([]) is None
    assert Summary.of(list(range(1, 11))).p90 == 9


def test_a_new_load_level_is_followed_not_remembered_as_a_burst():
    rng = random.Random(2)
    forecaster = Forecaster()
    t = 0.0
    for rate, intervals in ((10.0, 20), (30.0, 30), (10.0, 8)):
        for _ in range(intervals):
            t += 10
            forecast = forecaster.update(observation(t, poisson_seconds(rng, rate, 10)))
    assert forecast.peak_rate < 13.0
