"""Where ``pdserve top``'s frames come from: the registry in etcd and the /metrics of every
worker and frontend, each read concurrently under its own deadline.

``Sources.read()`` returns one ``top_view.Snapshot``. A source past its deadline or failing
is named in ``Snapshot.unanswered`` and its values are left unknown, so a frame is late by at
most one deadline whatever hangs. When etcd does not answer, the last registry data it gave
is shown with its age. Migrations come from the frontends' ``pdserve_migrations`` counters
(each frontend publishes its /metrics address in its stats record); the count since the
previous frame is the difference of their sums, counted only over frontends seen both times.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

from pdserve.cli.status import merged_latency
from pdserve.cli.operate import read_workers
from pdserve.cli.top_view import ModelView, Snapshot, WorkerRow
from pdserve.discovery.etcd import ETCD_ERRORS, EtcdConnection, RegistryUnavailable
from pdserve.discovery.knobs import Knobs, list_knobs
from pdserve.discovery.registry import WorkerEntry
from pdserve.discovery.slo import SLOTargets
from pdserve.discovery.slo_store import list_slos
from pdserve.observability.frontend_stats import FrontendStats, ModelStats, list_frontend_stats
from pdserve.planner.deployed_knobs import deployed_knobs

T = TypeVar("T")

# One scrape's series: metric name -> [(labels, value)].
Series = dict[str, list[tuple[dict[str, str], float]]]


@dataclass(frozen=True)
class _Registry:
    """What one etcd read gave."""

    workers: list[WorkerEntry]
    slos: list[SLOTargets]
    frontends: list[FrontendStats]
    knobs: dict[str, Knobs]
    read_at: float


class Sources:
    """The reads behind each frame; keeps what the next frame is compared with (migrations,
    the last registry data). One per ``pdserve top`` run."""

    def __init__(self, etcd: EtcdConnection, deadline_s: float, interval_s: float, model: str | None = None) -> None:
        self._etcd = etcd
        self._deadline_s = deadline_s
        self._interval_s = interval_s
        self._model = model
        self._frame = 0
        self._registry: _Registry | None = None
        self._migrations: dict[str, dict[str, float]] | None = None  # frontend -> model -> counter

    async def read(self) -> Snapshot:
        """One frame's data, in at most about one deadline."""
        self._frame += 1
        unanswered: dict[str, str] = {}
        now = time.time()
        try:
            self._registry = await self._read_registry(now)
        except ETCD_ERRORS + (RegistryUnavailable,) as error:
            unanswered[f"etcd {self._etcd.url}"] = _why(error, self._deadline_s)
        registry = self._registry
        if registry is None:
            return Snapshot(self._etcd.url, now, self._frame, self._interval_s, unanswered=unanswered)
        workers = [w for w in registry.workers if self._model in (None, w.model)]
        frontends = [f for f in registry.frontends if f.metrics_endpoint]
        endpoints = [_worker_metrics(w) for w in workers] + [f.metrics_endpoint or "" for f in frontends]
        scrapes = await asyncio.gather(*(self._scrape(e) for e in endpoints if e))
        by_endpoint: dict[str, Series] = {}
        for endpoint, result in zip([e for e in endpoints if e], scrapes):
            if isinstance(result, str):
                unanswered[f"metrics {endpoint}"] = result
            else:
                by_endpoint[endpoint] = result
        counters = {
            f.frontend_id: _by_model(by_endpoint[f.metrics_endpoint], "pdserve_migrations_total")
            for f in frontends
            if f.metrics_endpoint in by_endpoint
        }
        models = self._models(registry, workers, by_endpoint, counters, now)
        self._migrations = counters
        return Snapshot(
            etcd=self._etcd.url,
            time=now,
            frame=self._frame,
            interval_s=self._interval_s,
            models=models,
            num_frontends=len(registry.frontends),
            unanswered=unanswered,
            etcd_age_s=now - registry.read_at if registry.read_at < now else None,
        )

    def _models(
        self,
        registry: _Registry,
        workers: list[WorkerEntry],
        scrapes: dict[str, Series],
        counters: dict[str, dict[str, float]],
        now: float,
    ) -> list[ModelView]:
        slos = {t.model: t for t in registry.slos}
        stats: dict[str, dict[str, tuple[float, ModelStats]]] = {}
        for frontend in registry.frontends:
            for name, model_stats in frontend.models.items():
                stats.setdefault(name, {})[frontend.frontend_id] = (frontend.updated_at, model_stats)
        names = {w.model for w in workers} | set(slos) | set(stats)
        views = []
        for name in sorted(n for n in names if self._model in (None, n)):
            entries = [w for w in workers if w.model == name]
            knobs = registry.knobs.get(name)
            source = "stored" if knobs is not None else "start-up"
            if knobs is None and entries:
                knobs = deployed_knobs(name, entries, registry.frontends)
            total, recent = self._migrations_of(name, counters)
            views.append(
                ModelView(
                    model=name,
                    workers=[_row(w, scrapes.get(_worker_metrics(w))) for w in entries],
                    slo=slos.get(name),
                    latency=merged_latency(stats.get(name, {}), now),
                    knobs=knobs,
                    knobs_source=source,
                    migrations_total=total,
                    migrations_recent=recent,
                )
            )
        return views

    def _migrations_of(self, model: str, counters: dict[str, dict[str, float]]) -> tuple[int | None, int | None]:
        if not counters:
            return None, None
        total = int(sum(c.get(model, 0.0) for c in counters.values()))
        if self._migrations is None:
            return total, None
        both = set(counters) & set(self._migrations)
        recent = sum(counters[f].get(model, 0.0) - self._migrations[f].get(model, 0.0) for f in both)
        return total, max(0, int(recent))  # a restarted frontend's counter starts again at 0

    async def _read_registry(self, now: float) -> _Registry:
        async with self._etcd.use() as client, asyncio.timeout(self._deadline_s):  # inside: a timeout drops it
            workers, slos, frontends, knobs = await asyncio.gather(
                read_workers(client),
                list_slos(client, self._deadline_s),
                list_frontend_stats(client, self._deadline_s),
                list_knobs(client, self._deadline_s),
            )
        return _Registry([w for w, _ in workers], slos, frontends, knobs, now)

    async def _scrape(self, endpoint: str) -> Series | str:
        """The endpoint's series, or why there are none."""
        try:
            text = await self._bounded(asyncio.to_thread(_get, f"http://{endpoint}/metrics", self._deadline_s))
            series: Series = {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    series.setdefault(sample.name, []).append((sample.labels, sample.value))
            return series
        except (OSError, ValueError) as error:  # TimeoutError is an OSError
            return _why(error, self._deadline_s)

    async def _bounded(self, call: Awaitable[T]) -> T:
        async with asyncio.timeout(self._deadline_s):
            return await call


# Metrics ports are reached directly: an $http_proxy is for the outside world, not the cluster.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str, timeout_s: float) -> str:
    with _OPENER.open(url, timeout=timeout_s) as response:
        return response.read().decode()


def _why(error: BaseException, deadline_s: float) -> str:
    if isinstance(error, TimeoutError) or not str(error):
        return f"no answer within {deadline_s:g}s"
    return f"{type(error).__name__}: {error}"


def _worker_metrics(entry: WorkerEntry) -> str:
    """host:port of the worker's /metrics: its gRPC endpoint's host; "" when it serves none."""
    if entry.metrics_port is None:
        return ""
    host = entry.endpoint.rsplit(":", 1)[0]
    return f"{host}:{entry.metrics_port}"


def _by_model(series: Series, name: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for labels, value in series.get(name, []):
        totals[labels.get("model", "")] = totals.get(labels.get("model", ""), 0.0) + value
    return totals


def _row(entry: WorkerEntry, series: Series | None) -> WorkerRow:
    def value(name: str) -> float | None:
        samples = None if series is None else series.get(name)
        return sum(v for _, v in samples) if samples else None

    preemptions = value("pdserve_preemptions_total")
    load = entry.load
    return WorkerRow(
        worker_id=entry.worker_id,
        role=entry.role,
        running=load.running,
        waiting=load.waiting,
        kv_usage=load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else None,
        draining=entry.draining,
        held_requests=load.held_requests,
        prefix_hit_rate=value("pdserve_prefix_cache_hit_rate"),
        num_preemptions=None if preemptions is None else int(preemptions),
    )
