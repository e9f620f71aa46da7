"""The planner on synthetic observations: what it scales, when, how far, and when it holds still."""

import json
import random

import pytest
from msgspec.structs import replace

from pdserve.discovery.knobs import Knobs
from pdserve.discovery.slo import SLOTargets
from pdserve.observability.summary import Summary
from pdserve.planner.config import PlannerConfig
from pdserve.planner.observation import Observation
from pdserve.planner.planner import Decision, Planner
from pdserve.planner.profile import DecodeGrid
from tests.planner.profiles import synthetic_profile

SLO = SLOTargets(model="m", ttft_p90_s=0.3, itl_p90_s=0.03, max_prefill_replicas=8, max_decode_replicas=8)
CONFIG = PlannerConfig()


def observe(
    planner: Planner,
    t: float,
    rate: float,
    *,
    ttft: float | None = None,
    itl: float | None = None,
    ready: tuple[int, int] | None = None,
    prompt: tuple[float, float] = (256.0, 550.0),
) -> Decision | None:
    """One 10-second interval at ``rate`` req/s; ready replicas default to what the planner wants."""
    p50, p90 = prompt
    count = round(rate * 10)
    lengths = Summary(count=count, mean=(p50 + p90) / 2, p50=p50, p90=p90, max=3 * p90) if count else None
    prefill, decode = ready if ready is not None else (planner.prefill_replicas, planner.decode_replicas)

    def latency(p90: float | None) -> Summary | None:
        return None if p90 is None else Summary(count=100, mean=p90 / 2, p50=p90 / 2, p90=p90, max=2 * p90)

    obs = Observation(
        model="m",
        time=t,
        interval_s=10.0,
        arrivals_per_s=[(count * (k + 1)) // 10 - (count * k) // 10 for k in range(10)],
        prompt_tokens=lengths,
        output_tokens=Summary(count=count, mean=100, p50=90, p90=180, max=400) if count else None,
        ttft_s=latency(ttft),
        itl_s=latency(itl),
        e2e_s=None,
        num_prefill_ready=prefill,
        num_decode_ready=decode,
        prefill_waiting=0,
        decode_running=0.0,
        decode_kv_usage=0.0,
        knobs=planner.knobs,
    )
    return planner.observe(obs)


def run(planner: Planner, intervals: int, rate: float, start: float = 0.0, **kwargs) -> list[tuple[float, Decision]]:
    decisions = []
    for k in range(intervals):
        t = start + 10.0 * (k + 1)
        decision = observe(planner, t, rate, **kwargs)
        if decision is not None:
            decisions.append((t, decision))
    return decisions


def make(prefill: int = 2, decode: int = 2, slo: SLOTargets = SLO) -> Planner:
    # A decode batch cap the synthetic profile's steps hold the ITL target at, and no local
    # prefill (every prompt on the prefill pool), so that the tests see only the changes they
    # are about.
    knobs = Knobs(decode_max_num_seqs=16, local_prefill_threshold_tokens=0)
    return Planner(slo, synthetic_profile(), CONFIG, prefill_replicas=prefill, decode_replicas=decode, knobs=knobs)


def test_nothing_happens_during_warmup():
    planner = make(prefill=1, decode=1)
    assert run(planner, CONFIG.warmup_intervals, rate=200.0) == []


def test_scales_prefill_on_a_predicted_ttft_breach():
    planner = make(prefill=1, decode=8)
    (t, decision), *_ = run(planner, 3, rate=60.0, ttft=0.2, itl=0.015)
    assert decision.prefill_replicas >= 3  # 60 req/s of ~30 ms prompts needs ~2 replicas busy
    assert any("TTFT" in reason and "prefill 1→" in reason for reason in decision.reasons)
    assert decision.predicted_ttft_p90_s is not None and decision.predicted_ttft_p90_s <= SLO.ttft_p90_s


def test_scales_prefill_by_one_on_an_observed_breach_the_model_did_not_predict():
    planner = make(prefill=2, decode=1)
    run(planner, CONFIG.warmup_intervals, rate=5.0)
    decision = observe(planner, 100.0, 5.0, ttft=0.5, itl=0.015)
    assert decision is not None and (decision.prefill_replicas, decision.decode_replicas) == (3, 1)
    assert "TTFT p90 500ms > target 300ms" in decision.reasons[0]
    # The new replica is still starting: no second step on the same breach.
    assert observe(planner, 110.0, 5.0, ttft=0.5, itl=0.015, ready=(2, 1)) is None
    # Ready, but within the up cool-down.
    assert CONFIG.up_cooldown_intervals == 2
    assert observe(planner, 120.0, 5.0, ttft=0.5, itl=0.015, ready=(3, 1)) is None
    # Past the cool-down, but the new replica's samples are still those of a cold start.
    assert CONFIG.cold_start_intervals == 2
    assert observe(planner, 130.0, 5.0, ttft=0.5, itl=0.015, ready=(3, 1)) is None
    decision = observe(planner, 140.0, 5.0, ttft=0.5, itl=0.015, ready=(3, 1))
    assert decision is not None and decision.prefill_replicas == 4


def test_scales_decode_on_an_itl_breach():
    planner = make(prefill=8, decode=1)
    (t, decision), *_ = run(planner, 3, rate=60.0, ttft=0.1, itl=0.05)
    assert decision.decode_replicas > 1
    assert any("ITL" in reason and "decode 1→" in reason for reason in decision.reasons)


def test_scales_down_one_at_a_time_when_both_have_slack():
    planner = make(prefill=6, decode=6)
    decisions = run(planner, 80, rate=5.0, ttft=0.05, itl=0.012)
    prefill = [d.prefill_replicas for _, d in decisions]
    decode = [d.decode_replicas for _, d in decisions]
    assert prefill[-1] == 1 and decode[-1] == 1
    for series, start in ((prefill, 6), (decode, 6)):
        steps = [b - a for a, b in zip([start] + series, series) if b != a]
        assert steps and all(step == -1 for step in steps)
    assert all("slack" in reason for _, d in decisions for reason in d.reasons)


def test_no_scale_down_while_observed_latency_is_near_target():
    planner = make(prefill=6, decode=6)
    # The model would shrink both pools, but what users see is not well under target.
    assert run(planner, 30, rate=5.0, ttft=0.25, itl=0.025) == []


def test_cool_down_after_a_change_before_scaling_down():
    planner = make(prefill=1, decode=1)
    up = run(planner, 3, rate=150.0)
    assert up and up[-1][1].prefill_replicas > 1
    changed_at, size = up[-1][0], up[-1][1].prefill_replicas
    down = run(planner, 40, rate=1.0, start=changed_at, ttft=0.02, itl=0.011)
    prefill_changes = [changed_at]
    for t, d in down:
        if d.prefill_replicas != size:
            assert size - max(1, int(size * CONFIG.max_shrink)) <= d.prefill_replicas < size
            prefill_changes.append(t)
            size = d.prefill_replicas
    assert len(prefill_changes) >= 3
    cool_down = 10.0 * CONFIG.down_cooldown_intervals
    assert all(b - a > cool_down for a, b in zip(prefill_changes, prefill_changes[1:]))


@pytest.mark.slow
def test_never_past_the_bounds():
    slo = SLOTargets(
        model="m",
        ttft_p90_s=0.3,
        itl_p90_s=0.03,
        min_prefill_replicas=2,
        max_prefill_replicas=5,
        min_decode_replicas=2,
        max_decode_replicas=4,
    )
    planner = make(prefill=9, decode=1, slo=slo)
    decisions = run(planner, 3, rate=2.0, ttft=0.02, itl=0.011)
    assert (decisions[0][1].prefill_replicas, decisions[0][1].decode_replicas) == (5, 2)  # clamped at once
    decisions += run(planner, 40, rate=2000.0, start=30.0, ttft=5.0, itl=1.0)
    decisions += run(planner, 100, rate=0.0, start=430.0)
    assert any(d.prefill_replicas == 5 and d.decode_replicas == 4 for _, d in decisions)
    assert decisions[-1][1].prefill_replicas == 2 and decisions[-1][1].decode_replicas == 2
    for _, d in decisions:
        assert 2 <= d.prefill_replicas <= 5 and 2 <= d.decode_replicas <= 4


def test_no_flapping_on_noise_around_a_steady_load():
    rng = random.Random(0)
    planner = make(prefill=1, decode=1)
    run(planner, 10, rate=40.0, ttft=0.1, itl=0.015)  # converge
    sizes = [(planner.prefill_replicas, planner.decode_replicas)]
    for k in range(200):
        rate = 40.0 * rng.uniform(0.9, 1.1)
        observe(planner, 110.0 + 10 * k, rate, ttft=0.3 * rng.uniform(0.5, 0.98), itl=0.03 * rng.uniform(0.5, 0.98))
        sizes.append((planner.prefill_replicas, planner.decode_replicas))
    for pool in (0, 1):
        series = [s[pool] for s in sizes]
        moves = [b - a for a, b in zip(series, series[1:]) if b != a]
        assert len(moves) <= 1, f"pool {pool} moved {moves}"


def test_knobs_move_only_at_the_maximum_and_come_back():
    # Prefill capped at 1 replica: TTFT cannot hold at 45 req/s, decode has room to spare.
    slo = SLOTargets(model="m", ttft_p90_s=0.3, itl_p90_s=0.03, max_prefill_replicas=1, max_decode_replicas=8)
    planner = make(prefill=1, decode=2, slo=slo)
    decisions = run(planner, 4, rate=45.0, ttft=1.0, itl=0.015)
    knobs = decisions[0][1].knobs
    assert knobs.local_prefill_threshold_tokens > 0
    assert any("local_prefill_threshold_tokens 0→" in r for r in decisions[0][1].reasons)
    assert all(d.prefill_replicas == 1 for _, d in decisions)
    # Load falls away: the knob returns to its default, after the cool-down.
    later = run(planner, 20, rate=2.0, start=40.0, ttft=0.02, itl=0.011)
    back = [(t, d) for t, d in later if d.knobs.local_prefill_threshold_tokens == 0]
    assert back and back[0][0] - decisions[-1][0] >= 10.0 * CONFIG.down_cooldown_intervals - 10.0


def test_the_chunk_size_rises_for_long_prompts_no_higher_than_the_workers_can_go():
    slo = SLOTargets(model="m", ttft_p90_s=0.3, itl_p90_s=0.03, max_prefill_replicas=1, max_decode_replicas=8)

    def chunk(limits: Knobs | None) -> int:
        planner = Planner(
            slo,
            synthetic_profile(),
            CONFIG,
            prefill_replicas=1,
            decode_replicas=2,
            knobs=Knobs(decode_max_num_seqs=16),
            knob_limits=limits,
        )
        decisions = run(planner, 4, rate=10.0, ttft=2.0, itl=0.015, prompt=(2000.0, 3000.0))
        return decisions[0][1].knobs.prefill_chunk_size if decisions else planner.knobs.prefill_chunk_size

    assert chunk(None) == 4096
    assert chunk(Knobs(prefill_chunk_size=2048)) == 2048


def test_a_planner_starts_from_the_knobs_in_force_and_returns_to_the_defaults():
    left = Knobs(decode_max_num_seqs=16, local_prefill_threshold_tokens=256)  # by an earlier planner
    planner = Planner(
        SLO,
        synthetic_profile(),
        CONFIG,
        prefill_replicas=2,
        decode_replicas=2,
        knobs=Knobs(decode_max_num_seqs=16),
        knobs_now=left,
    )
    assert planner.knobs == left
    decisions = run(planner, 3 + CONFIG.down_cooldown_intervals, rate=2.0, ttft=0.02, itl=0.011)
    assert decisions and decisions[-1][1].knobs == Knobs(decode_max_num_seqs=16)


def test_decode_batch_is_capped_where_a_step_would_miss_the_itl_target():
    # A decode step that grows steeply with the batch: past about 14 sequences of ~1000
    # tokens a step takes longer than 0.85 x the 23 ms target.
    steep = DecodeGrid(batches=[1, 64], context_per_seq=[128, 1024], seconds=[[0.002, 0.003], [0.04, 0.08]])
    slo = SLOTargets(model="m", ttft_p90_s=0.3, itl_p90_s=0.023, max_prefill_replicas=8, max_decode_replicas=8)
    profile = replace(synthetic_profile(), decode=steep)
    planner = Planner(slo, profile, prefill_replicas=8, decode_replicas=8)
    (_, decision), *_ = run(planner, 3, rate=2.0, ttft=0.05, itl=0.01, prompt=(900.0, 1000.0))
    cap = decision.knobs.decode_max_num_seqs
    assert 1 < cap < 64 and any("decode_max_num_seqs 64→" in r for r in decision.reasons)
    context = 950 + 100 / 2  # mean prompt + half the mean output
    assert profile.decode_step_seconds(cap, cap * context) <= 0.85 * 0.023
    assert profile.decode_step_seconds(cap + 1, (cap + 1) * context) > 0.85 * 0.023


def test_decision_json_is_published_with_unbounded_predictions_as_null():
    slo = SLOTargets(model="m", ttft_p90_s=0.3, itl_p90_s=0.03, max_prefill_replicas=2, max_decode_replicas=2)
    planner = make(prefill=1, decode=1, slo=slo)
    (_, decision), *_ = run(planner, 3, rate=1000.0, ttft=5.0, itl=1.0)
    payload = json.loads(decision.encode())
    assert (payload["prefill_replicas"], payload["decode_replicas"]) == (2, 2) and payload["reasons"]
    assert payload["predicted_ttft_p90_s"] is None and payload["predicted_itl_p90_s"] is None


@pytest.mark.parametrize("field", ["scale_down_below", "size_to"])
def test_config_rejects_margins_out_of_order(field):
    with pytest.raises(ValueError):
        PlannerConfig(**{field: 1.5})
