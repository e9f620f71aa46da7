"""RollingWindow: percentiles (not averages) over the last window_s seconds, on a fake clock."""

from __future__ import annotations

import pytest

from pdserve.observability.frontend_stats import FrontendStats, ModelStats, RollingWindow


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def window(window_s: float = 60.0, **kwargs) -> tuple[RollingWindow, FakeClock]:
    clock = FakeClock()
    w = RollingWindow(window_s, clock=clock, **kwargs)
    clock.now += window_s  # past start-up: the stats cover the whole window
    return w, clock


def test_percentiles_are_nearest_rank_not_means() -> None:
    w, clock = window()
    for i in range(1, 101):  # TTFT 1..100 ms, one request per 0.1 s, all finished by now
        w.arrived("m", clock.now - 20 + i * 0.1)
        w.record(
            "m",
            clock.now - 20 + i * 0.1,
            ttft_s=i / 1e3,
            itl_s=None,
            e2e_s=i / 1e2,
            prompt_tokens=i,
            output_tokens=2 * i,
        )
    stats = w.stats("m")
    assert stats is not None
    assert stats.num_requests == 100 and stats.num_errors == 0
    assert stats.ttft_p50_ms == pytest.approx(50) and stats.ttft_p90_ms == pytest.approx(90)
    assert stats.e2e_p90_ms == pytest.approx(900)
    assert (stats.prompt_tokens_p50, stats.prompt_tokens_p90) == (50, 90)
    assert (stats.output_tokens_p50, stats.output_tokens_p90) == (100, 180)
    assert stats.itl_p50_ms is None and stats.itl_p90_ms is None  # no sample: None, not 0
    assert stats.window_s == 60 and stats.arrival_rate == pytest.approx(100 / 60)


def test_a_tail_shows_in_the_p90_where_a_mean_would_hide_it() -> None:
    w, clock = window()
    for i in range(10):  # one request in ten is slow
        w.record(
            "m", clock.now - 5, ttft_s=2.0 if i == 9 else 0.1, itl_s=None, e2e_s=3.0, prompt_tokens=8, output_tokens=1
        )
    stats = w.stats("m")
    assert stats.ttft_p50_ms == pytest.approx(100)
    assert stats.ttft_p90_ms == pytest.approx(100)  # 9 of 10 are fast: nearest rank 9 is 100 ms
    w.record("m", clock.now - 5, ttft_s=2.0, itl_s=None, e2e_s=3.0, prompt_tokens=8, output_tokens=1)
    assert w.stats("m").ttft_p90_ms == pytest.approx(2000)  # now 2 of 11 are slow


def test_itl_is_each_requests_mean_gap_so_every_request_weighs_the_same() -> None:
    w, clock = window()
    # A short request with slow gaps, a long one with fast gaps: per request, the slow one is
    # half the sample (counted per gap, the long request's 97 fast gaps would hide it).
    w.record("m", clock.now - 10, ttft_s=0.1, itl_s=[0.1] * 3, e2e_s=1.0, prompt_tokens=4, output_tokens=4)
    w.record("m", clock.now - 10, ttft_s=0.1, itl_s=[0.01] * 97, e2e_s=2.0, prompt_tokens=4, output_tokens=98)
    stats = w.stats("m")
    assert stats.itl_p50_ms == pytest.approx(10) and stats.itl_p90_ms == pytest.approx(100)
    # A mean gap is taken as it is.
    for _ in range(8):
        w.record("m", clock.now - 10, ttft_s=0.1, itl_s=0.05, e2e_s=3.0, prompt_tokens=4, output_tokens=201)
    assert w.stats("m").itl_p90_ms == pytest.approx(50)
    # One output token has no gap: its mean is ignored.
    w2, clock2 = window()
    w2.record("m", clock2.now - 1, ttft_s=0.1, itl_s=0.05, e2e_s=0.1, prompt_tokens=4, output_tokens=1)
    assert w2.stats("m").itl_p90_ms is None


def test_arrivals_count_when_requests_arrive_second_by_second() -> None:
    w, clock = window(window_s=10)
    clock.now = 2000.5
    for t in (1990.2, 1995.0, 1995.9, 2000.1, 2000.4):  # the first is out of the window (1990.5, 2000.5]
        w.arrived("m", t)
    stats = w.stats("m")
    assert stats is not None and stats.num_requests == 0  # none finished yet: a burst shows anyway
    assert stats.arrivals_per_s == [0, 0, 0, 0, 2, 0, 0, 0, 0, 2]  # seconds 1991..2000
    assert stats.arrival_rate == pytest.approx(4 / 10)
    assert stats.ttft_p90_ms is None


def test_old_requests_leave_the_window() -> None:
    w, clock = window(window_s=10)
    w.record("m", clock.now - 1, ttft_s=1.0, itl_s=None, e2e_s=0.5, prompt_tokens=4, output_tokens=1)
    clock.now += 5
    w.record("m", clock.now - 1, ttft_s=0.1, itl_s=None, e2e_s=0.5, prompt_tokens=4, output_tokens=1)
    assert w.stats("m").num_requests == 2
    clock.now += 6  # the first finished 10.5 s ago
    stats = w.stats("m")
    assert stats.num_requests == 1 and stats.ttft_p90_ms == pytest.approx(100)
    clock.now += 10
    assert w.stats("m") is None
    assert w.snapshot("fe-1").models == {}


def test_errors_count_but_have_no_latency() -> None:
    w, clock = window()
    w.record("m", clock.now - 2, ttft_s=None, itl_s=None, e2e_s=None, prompt_tokens=10, output_tokens=None, ok=False)
    stats = w.stats("m")
    assert stats.num_requests == 1 and stats.num_errors == 1
    assert stats.ttft_p90_ms is None and stats.e2e_p90_ms is None and stats.output_tokens_p90 is None
    assert stats.prompt_tokens_p90 == 10


def test_just_after_start_the_rate_is_over_the_time_covered() -> None:
    clock = FakeClock()
    w = RollingWindow(60.0, clock=clock)
    clock.now += 5
    for _ in range(10):
        w.arrived("m", clock.now - 1.5)
        w.record("m", clock.now - 1, ttft_s=0.1, itl_s=None, e2e_s=0.5, prompt_tokens=4, output_tokens=1)
    stats = w.stats("m")
    assert stats.window_s == pytest.approx(5) and stats.arrival_rate == pytest.approx(2)
    assert stats.arrivals_per_s == [0, 0, 10, 0, 0]  # seconds 1001..1005


def test_snapshot_covers_every_model_and_round_trips_as_json() -> None:
    w, clock = window()
    for model in ("a", "org/b"):
        w.record(model, clock.now - 2, ttft_s=0.2, itl_s=[0.02, 0.03], e2e_s=1.0, prompt_tokens=7, output_tokens=3)
    snapshot = w.snapshot("frontend-0")
    assert snapshot.frontend_id == "frontend-0" and snapshot.updated_at == clock.now
    assert set(snapshot.models) == {"a", "org/b"}
    assert FrontendStats.decode(snapshot.encode()) == snapshot
    # A reader tolerates fields it does not know and fields a writer left out.
    old = b'{"frontend_id":"f","updated_at":1.0,"models":{"m":{"window_s":60,"num_requests":0,"arrival_rate":0}},"x":1}'
    assert FrontendStats.decode(old).models["m"] == ModelStats(window_s=60, num_requests=0, arrival_rate=0)
    with pytest.raises(ValueError, match="frontend stats do not decode"):
        FrontendStats.decode(b'{"frontend_id": 3}')


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="window_s"):
        RollingWindow(0)


def test_arrivals_from_before_the_window_was_made_extend_what_it_covers() -> None:
    clock = FakeClock()
    w = RollingWindow(60.0, clock=clock)
    for i in range(30):  # fed at once, e.g. replayed from a log: arrivals over the last 30 s
        w.arrived("m", clock.now - 30 + i)
        w.record("m", clock.now - 30 + i, ttft_s=0.1, itl_s=None, e2e_s=0.0, prompt_tokens=4, output_tokens=1)
    stats = w.stats("m")
    assert stats.window_s == pytest.approx(30) and stats.arrival_rate == pytest.approx(1)
