"""The planner's Prometheus metrics: each planned model's SLO targets and the planner's decisions.

The targets live in etcd (``discovery.slo_store``) and only the planner follows them, so the
planner exports them: a dashboard draws TTFT and ITL against ``pdserve_slo_*_p90_seconds``
rather than a number typed into it. ``PlannerMetrics`` owns its registry (served by
``pdserve planner --metrics-port``); the service calls ``planned`` for every model at every
step, ``decided`` when a decision is made, and ``forget`` when a model's targets are removed,
so a removed model's series disappear instead of going stale.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.discovery.registry import Role
from pdserve.discovery.slo import SLOTargets


class PlannerMetrics:
    """Series labelled by model (and role, for the pools' sizes)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft_target = Gauge("pdserve_slo_ttft_p90_seconds", "TTFT p90 target", ["model"], registry=r)
        self.itl_target = Gauge(
            "pdserve_slo_itl_p90_seconds", "ITL p90 target (a request's mean gap)", ["model"], registry=r
        )
        self.e2e_target = Gauge(
            "pdserve_slo_e2e_p90_seconds", "End-to-end p90 target, where one is set", ["model"], registry=r
        )
        self.replicas = Gauge(
            "pdserve_planner_replicas", "The replicas the planner wants in each pool", ["model", "role"], registry=r
        )
        self.decisions = Counter(
            "pdserve_planner_decisions", "Decisions that resized pools or retuned knobs", ["model"], registry=r
        )
        self.peak_rate = Gauge(
            "pdserve_planner_peak_rate", "The forecast requests/s the pools were last sized for", ["model"], registry=r
        )

    def planned(self, slo: SLOTargets, prefill_replicas: int, decode_replicas: int) -> None:
        """The model's targets and its pools' wanted sizes after this step."""
        model = slo.model
        self.ttft_target.labels(model).set(slo.ttft_p90_s)
        self.itl_target.labels(model).set(slo.itl_p90_s)
        if slo.e2e_p90_s is None:
            self._remove(self.e2e_target, model)
        else:
            self.e2e_target.labels(model).set(slo.e2e_p90_s)
        self.replicas.labels(model, Role.PREFILL.value).set(prefill_replicas)
        self.replicas.labels(model, Role.DECODE.value).set(decode_replicas)

    def decided(self, model: str, peak_rate: float) -> None:
        """One decision, sized for ``peak_rate`` requests/s."""
        self.decisions.labels(model).inc()
        self.peak_rate.labels(model).set(peak_rate)

    def forget(self, model: str) -> None:
        """Drop every series of a model that is no longer planned."""
        for metric in (self.ttft_target, self.itl_target, self.e2e_target, self.decisions, self.peak_rate):
            self._remove(metric, model)
        for role in Role:
            self._remove(self.replicas, model, role.value)

    @staticmethod
    def _remove(metric: Gauge | Counter, *labels: str) -> None:
        try:
            metric.remove(*labels)
        except KeyError:  # never set
            pass
