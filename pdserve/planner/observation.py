"""What the planner sees of one model each interval, and the knobs it can turn.

An ``Observation`` is built from two sources: the frontends (arrivals, prompt and output
lengths, TTFT / ITL / end-to-end latencies of the requests they served in the interval) and
the workers' load entries in etcd (``WorkerEntry.load``: ready replicas, waiting and
running requests, KV usage). Each producer keeps raw samples for one interval and hands them
to ``Summary.of``; the observation itself carries only summaries, so its size does not grow
with load and it can be stored, logged and sent as it is.

Summaries rather than raw samples: the planner needs tails (p90) and bursts, not the
individual values, and a fixed-size record can be merged into a decision log and published.
Per-second arrival counts are kept raw (``arrivals_per_s``) because the burst detector needs
their shape within the interval, and an interval holds only ``interval_s`` of them.
"""

from __future__ import annotations

import msgspec

from pdserve.discovery.knobs import Knobs
from pdserve.observability.summary import Summary


class Observation(msgspec.Struct, frozen=True, kw_only=True):
    """One model's traffic, latency and pool state over one planner interval.

    Latency summaries are None when the interval had no sample; each covers the requests
    that got their first token (``ttft``) or finished (``itl``, ``e2e``) in the interval.
    ITL is per request: its mean gap between tokens, ``(last token - first token) / (tokens
    - 1)``, so a request that waited for a decode slot counts that wait in full, not as one
    gap among the thousands a busy interval produces. ``prompt_tokens`` covers requests that
    arrived; ``output_tokens`` requests that finished (an output length is known only at
    the end).
    """

    model: str
    time: float  # end of the interval, seconds (any clock the producer keeps steady)
    interval_s: float
    arrivals_per_s: list[int]  # arrivals in each consecutive second of the interval
    prompt_tokens: Summary | None
    output_tokens: Summary | None
    ttft_s: Summary | None
    itl_s: Summary | None
    e2e_s: Summary | None
    num_prefill_ready: int
    num_decode_ready: int
    prefill_waiting: int  # requests waiting in the prefill pool at the end of the interval
    decode_running: float  # mean running requests per ready decode worker
    decode_kv_usage: float  # mean fraction of KV blocks in use per ready decode worker
    knobs: Knobs
    # False when no frontend reported in the interval: arrivals and latencies are then
    # unknown, not zero, and the planner holds its pools as they are.
    traffic_observed: bool = True

    @property
    def num_arrivals(self) -> int:
        return sum(self.arrivals_per_s)

    @property
    def arrival_rate(self) -> float:
        """Mean arrivals per second over the interval."""
        return self.num_arrivals / self.interval_s
