"""Observability: Prometheus metrics for every process, and the latency statistics frontends publish.

- ``metrics``: the worker's and the frontend's Prometheus collectors, and ``serve_metrics``.
- ``planner_metrics``: the planner's collectors: each planned model's SLO targets, wanted pool sizes and decisions.
- ``probes``: the metrics port's HTTP server: ``/metrics``, and the ``/readyz`` and ``/livez`` probes.
- ``frontend_stats``: each frontend's rolling window of TTFT / ITL / end-to-end latencies,
  published in etcd for ``pdserve status`` and the planner.
- ``logs``: ``configure``, the one place a process's logging is set up (text or JSON lines), and ``bind``.
- ``summary``: the fixed-size summary of samples those records carry.
"""
