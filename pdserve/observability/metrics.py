"""Prometheus metrics of the workers, the frontend and ``pdserve up``'s supervisor, each on its
own ``/metrics`` port.

Every process owns its registry (no module-level singletons): ``WorkerMetrics`` and
``FrontendMetrics`` hold the counters and histograms the request paths update, and read
occupancy (running, waiting, KV blocks, held requests, preemptions) from the engine's load at
scrape time, so a gauge is never stale. GPU utilisation and memory come from NVML where a GPU
exists; without one those series are simply absent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.observability.probes import MetricsServer
from pdserve.types.engine_load import EngineLoad

logger = logging.getLogger(__name__)

# Seconds: from sub-millisecond CPU steps to minute-long queues.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _OccupancyCollector(Collector):
    def __init__(self, read: Callable[[], EngineLoad], labels: dict[str, str]) -> None:
        self.read = read
        self.labels = labels

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        now = self.read()
        names, values = list(self.labels), list(self.labels.values())
        for name, doc, value in (
            ("pdserve_running_requests", "Requests running (or awaiting KV) on the engine", now.running),
            ("pdserve_waiting_requests", "Requests queued on the engine", now.waiting),
            ("pdserve_kv_blocks_used", "KV blocks referenced by requests", now.kv_blocks_used),
            (
                "pdserve_kv_blocks_free",
                "KV blocks free or cached-unreferenced",
                now.kv_blocks_total - now.kv_blocks_used,
            ),
            ("pdserve_held_requests", "Prefill: requests whose blocks are pinned for a pull", now.held_requests),
        ):
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
        preemptions = CounterMetricFamily("pdserve_preemptions", "Requests preempted for recompute", labels=names)
        preemptions.add_metric(values, now.num_preemptions)
        yield preemptions


class _GpuCollector(Collector):
    """GPU utilisation and memory through NVML; nothing at all where there is no GPU."""

    def __init__(self) -> None:
        self._handles: list[object] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as exc:  # no driver, no GPU, no package: not an error
            logger.debug("no GPU metrics: %s", exc)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if not self._handles:
            return
        util = GaugeMetricFamily("pdserve_gpu_utilization", "GPU utilisation (0-1)", labels=["gpu"])
        used = GaugeMetricFamily("pdserve_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu"])
        total = GaugeMetricFamily("pdserve_gpu_memory_total_bytes", "GPU memory", labels=["gpu"])
        for index, handle in enumerate(self._handles):
            memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            util.add_metric([str(index)], self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)
            used.add_metric([str(index)], memory.used)
            total.add_metric([str(index)], memory.total)
        yield from (util, used, total)


class WorkerMetrics:
    """A worker's metrics; ``labels`` (role, worker, model) are on every series; the occupancy
    gauges read ``load()`` at scrape time."""

    def __init__(self, role: str, worker_id: str, model: str, load: Callable[[], EngineLoad]) -> None:
        self.registry = CollectorRegistry()
        labels = {"role": role, "worker": worker_id, "model": model}
        names = list(labels)
        r = self.registry
        self.queue_seconds = Histogram(
            "pdserve_queue_seconds",
            "Time a request waited in the engine queue",
            names,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.prefill_seconds = Histogram(
            "pdserve_prefill_seconds",
            "Prompt computation, first token included",
            names,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.kv_transfer_seconds = Histogram(
            "pdserve_kv_transfer_seconds", "One request's KV pull", names, buckets=LATENCY_BUCKETS, registry=r
        ).labels(**labels)
        self.resume_seconds = Histogram(
            "pdserve_kv_resume_seconds",
            "Decode role: a pulled request's KV landed -> its next token (joining the step under way, or waiting for the next)",
            names,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.kv_transfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes pulled", names, registry=r).labels(
            **labels
        )
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens admitted", names, registry=r).labels(
            **labels
        )
        self.cached_prompt_tokens = Counter(
            "pdserve_cached_prompt_tokens", "Prompt tokens served from the prefix cache", names, registry=r
        ).labels(**labels)
        self.requests = Counter(
            "pdserve_worker_requests", "Requests ended, by outcome", [*names, "outcome"], registry=r
        )
        self._labels = labels
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0
        hit_rate = Gauge("pdserve_prefix_cache_hit_rate", "Cached over admitted prompt tokens", names, registry=r)
        hit_rate.labels(**labels).set_function(self._hit_rate)
        r.register(_OccupancyCollector(load, labels))
        r.register(_GpuCollector())

    def _hit_rate(self) -> float:
        return self._num_cached_tokens / self._num_prompt_tokens if self._num_prompt_tokens else 0.0

    def request_ended(self, outcome: str) -> None:
        self.requests.labels(**self._labels, outcome=outcome).inc()

    def prompt_admitted(self, num_tokens: int, num_cached: int) -> None:
        self.prompt_tokens.inc(num_tokens)
        self.cached_prompt_tokens.inc(num_cached)
        self._num_prompt_tokens += num_tokens
        self._num_cached_tokens += num_cached


class FrontendMetrics:
    """The frontend's request-level latency metrics, labelled by model."""

    def __init__(self, in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft_seconds = Histogram(
            "pdserve_ttft_seconds", "Time to first token", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl_seconds = Histogram(
            "pdserve_itl_seconds",
            "Inter-token latency, one sample per gap "
            "(pdserve status and the planner judge ITL per request: its mean gap)",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_seconds = Histogram(
            "pdserve_e2e_seconds",
            "Request latency, arrival to last token",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter("pdserve_requests", "Requests ended, by gRPC status", ["model", "code"], registry=r)
        self.migrations = Counter(
            "pdserve_migrations",
            "Requests moved to another decode worker after a stream broke (one per move)",
            ["model"],
            registry=r,
        )
        self.kv_transfer_share = Histogram(
            "pdserve_kv_transfer_ttft_share",
            "KV transfer time over TTFT",
            ["model"],
            buckets=(0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0),
            registry=r,
        )
        queue = Gauge("pdserve_queue_length", "Requests in flight at the frontend", registry=r)
        queue.set_function(in_flight)


class SupervisorMetrics:
    """``pdserve up``'s children: crashes, restarts and give-ups, by child and role."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["child", "role"]
        r = self.registry
        self._crashes = Counter(
            "pdserve_child_crashes", "Children that died on their own, or failed to restart", labels, registry=r
        )
        self._restarts = Counter("pdserve_child_restarts", "Restarts of a child that died", labels, registry=r)
        self._gave_up = Counter(
            "pdserve_child_gave_up", "Children given up on after too many restarts in a row", labels, registry=r
        )

    def crashed(self, child: str, role: str) -> None:
        self._crashes.labels(child, role).inc()

    def restarted(self, child: str, role: str) -> None:
        self._restarts.labels(child, role).inc()

    def gave_up(self, child: str, role: str) -> None:
        self._gave_up.labels(child, role).inc()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve ``registry`` at ``http://host:port/metrics`` on a daemon thread; returns the bound port."""
    return MetricsServer.start(registry, host, port).port
