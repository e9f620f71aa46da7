"""The planner against the failure modes of replica planners: cold-start samples, replicas that
stay Pending, a flapping load, and metrics that go missing."""

from pdserve.discovery.knobs import Knobs
from pdserve.discovery.slo import SLOTargets
from pdserve.planner.observer import observe as observe_etcd
from pdserve.planner.planner import Planner
from tests.planner.profiles import synthetic_profile
from tests.planner.test_planner import CONFIG, SLO, make, observe, run


def sizes(decisions) -> list[tuple[int, int]]:
    return [(d.prefill_replicas, d.decode_replicas) for _, d in decisions]


def test_cold_start_samples_do_not_scale_up():
    # The deployment starts with the planner: 2 + 2 replicas (its minimum) starting, then
    # ready, their first requests slow (warm-up) for two intervals, at a load 2 + 2 carries.
    slo = SLOTargets(
        model="m", ttft_p90_s=0.3, itl_p90_s=0.03, min_prefill_replicas=2, min_decode_replicas=2, max_prefill_replicas=8
    )
    planner = make(prefill=2, decode=2, slo=slo)
    decisions = run(planner, 3, rate=5.0, ready=(0, 0))
    decisions += run(planner, 2, rate=5.0, start=30.0, ttft=1.5, itl=0.15)
    decisions += run(planner, 10, rate=5.0, start=50.0, ttft=0.05, itl=0.012)
    assert all(p <= 2 and d <= 2 for p, d in sizes(decisions)), sizes(decisions)


def test_cold_start_samples_of_new_replicas_do_not_scale_up_again():
    planner = make(prefill=2, decode=1)
    run(planner, CONFIG.warmup_intervals, rate=5.0)
    decision = observe(planner, 100.0, 5.0, ttft=0.5, itl=0.015)  # a real breach: one more
    assert decision is not None and decision.prefill_replicas == 3
    run(planner, 3, rate=5.0, start=100.0, ttft=0.5, itl=0.015, ready=(2, 1))  # starting
    # Ready now; its first samples are slow, then it is warm and the pool holds.
    decisions = run(planner, 2, rate=5.0, start=130.0, ttft=0.5, itl=0.015)
    decisions += run(planner, 5, rate=5.0, start=150.0, ttft=0.1, itl=0.015)
    assert all(p <= 3 for p, _ in sizes(decisions)), sizes(decisions)


def test_pending_replicas_are_no_reason_to_ask_for_more_without_bound():
    slo = SLOTargets(model="m", ttft_p90_s=0.3, itl_p90_s=0.03, max_prefill_replicas=64, max_decode_replicas=64)
    planner = make(prefill=1, decode=1, slo=slo)
    run(planner, CONFIG.warmup_intervals, rate=5.0)
    # The load climbs while no new replica ever becomes ready (no room in the cluster):
    # what is requested and not ready stays within max_pending.
    decisions = []
    for k in range(40):
        rate = 10.0 + 20.0 * k
        decisions += run(planner, 1, rate=rate, start=100.0 + 10 * k, ttft=2.0, itl=0.2, ready=(1, 1))
    assert decisions and max(max(p, d) for p, d in sizes(decisions)) == 1 + 16  # max_pending


def test_a_flapping_load_does_not_flap_replicas():
    # 90 s at 60 req/s, 90 s at 5, for 40 minutes: after the first shrink is undone, the
    # down cool-down doubles past the lull, and the pools hold.
    planner = make(prefill=1, decode=1)
    decisions = []
    for cycle in range(13):
        start = cycle * 180.0
        decisions += run(planner, 9, rate=60.0, start=start, ttft=0.1, itl=0.015)
        decisions += run(planner, 9, rate=5.0, start=start + 90.0, ttft=0.05, itl=0.012)
    for pool in (0, 1):
        series = [size[pool] for size in sizes(decisions)]
        turns = sum((b - a) * (c - b) < 0 for a, b, c in zip(series, series[1:], series[2:]))
        assert turns <= 3, series


def test_one_step_up_and_down_is_not_flapping():
    # The pools shrink in a lull, climb in several scale-ups when the load triples, and the
    # load falls back: one reversal each way, so the pools shrink again at the usual pace
    # instead of holding the peak for a doubled (and redoubled, per scale-up) cool-down.
    planner = make(prefill=4, decode=4)
    decisions = run(planner, 20, rate=5.0)
    for k, rate in enumerate((15.0, 30.0, 45.0, 60.0)):
        decisions += run(planner, 1, rate=rate, start=200.0 + 10 * k)
    decisions += run(planner, 16, rate=60.0, start=240.0)
    peak = sizes(decisions)[-1]
    assert min(peak) > 1, sizes(decisions)
    after = run(planner, 40, rate=5.0, start=400.0)
    soon = [d for t, d in after if t <= 400.0 + 10 * (CONFIG.down_cooldown_intervals + 2)]
    assert any(d.prefill_replicas < peak[0] for d in soon), sizes(after)
    assert any(d.decode_replicas < peak[1] for d in soon), sizes(after)
    assert max(sizes(after)[-1]) <= 2, sizes(after)
    assert not any("undone" in reason for _, d in decisions + after for reason in d.reasons)


def test_missing_metrics_freeze_decisions():
    planner = make(prefill=4, decode=4)
    run(planner, 12, rate=60.0, ttft=0.1, itl=0.015)
    before = (planner.prefill_replicas, planner.decode_replicas, planner.knobs)
    # Every frontend is gone (or stopped publishing): the observer sees no stats at all.
    for k in range(60):
        obs = observe_etcd("m", [], [], planner.knobs, now=1000.0 + 10 * k, interval_s=10)
        assert planner.observe(obs) is None
    assert (planner.prefill_replicas, planner.decode_replicas, planner.knobs) == before
    # The metrics return at the same load: nothing was lost.
    decisions = run(planner, 3, rate=60.0, start=2000.0, ttft=0.1, itl=0.015)
    assert all(size == before[:2] for size in sizes(decisions))


def test_real_zero_traffic_still_scales_down():
    planner = Planner(
        SLO, synthetic_profile(), CONFIG, prefill_replicas=4, decode_replicas=4, knobs=Knobs(decode_max_num_seqs=16)
    )
    decisions = run(planner, 80, rate=0.0)
    assert sizes(decisions)[-1] == (1, 1)
