"""PlannerMetrics: the targets and sizes a step sets, decisions counted, a forgotten model's series gone."""

from __future__ import annotations

from prometheus_client import generate_latest

from pdserve.discovery.slo import SLOTargets
from pdserve.observability.planner_metrics import PlannerMetrics


def test_a_planned_model_exports_its_targets_sizes_and_decisions_until_forgotten() -> None:
    metrics = PlannerMetrics()
    value = metrics.registry.get_sample_value
    metrics.planned(SLOTargets(model="m", ttft_p90_s=0.5, itl_p90_s=0.03, e2e_p90_s=8.0), 2, 3)
    metrics.decided("m", peak_rate=12.5)
    metrics.decided("m", peak_rate=14.0)
    assert value("pdserve_slo_ttft_p90_seconds", {"model": "m"}) == 0.5
    assert value("pdserve_slo_itl_p90_seconds", {"model": "m"}) == 0.03
    assert value("pdserve_slo_e2e_p90_seconds", {"model": "m"}) == 8.0
    assert value("pdserve_planner_replicas", {"model": "m", "role": "prefill"}) == 2
    assert value("pdserve_planner_replicas", {"model": "m", "role": "decode"}) == 3
    assert value("pdserve_planner_decisions_total", {"model": "m"}) == 2
    assert value("pdserve_planner_peak_rate", {"model": "m"}) == 14.0

    # The end-to-end target dropped: its series goes rather than keep the old number.
    metrics.planned(SLOTargets(model="m", ttft_p90_s=0.4, itl_p90_s=0.03), 2, 4)
    assert value("pdserve_slo_e2e_p90_seconds", {"model": "m"}) is None
    assert value("pdserve_slo_ttft_p90_seconds", {"model": "m"}) == 0.4

    metrics.planned(SLOTargets(model="other", ttft_p90_s=1.0, itl_p90_s=0.05), 1, 1)
    metrics.forget("m")
    metrics.forget("never-planned")  # nothing to drop: not an error
    text = generate_latest(metrics.registry).decode()
    assert 'model="m"' not in text and 'model="other"' in text
