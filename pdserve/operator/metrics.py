"""The operator's Prometheus metrics: reconciles, their failures and their duration."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdserve.observability.metrics import LATENCY_BUCKETS


class OperatorMetrics:
    """One registry per operator process, served on its ``--metrics-port``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter(
            "pdserve_operator_reconciles",
            "Reconciles of a PDServeDeployment, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.errors = Counter(
            "pdserve_operator_reconcile_errors",
            "Reconciles that failed, by error type",
            ["error"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "pdserve_operator_reconcile_seconds",
            "Duration of one reconcile",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
