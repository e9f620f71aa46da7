"""What the planner sees of one model each interval, and the knobs it can turn.

An ``Observation`` is built from two sources: the frontends (arrivals, prompt and output
lengths, TTFT / ITL / end-to-end latencies of the requests they served in the interval) and
the workers' load entries in etcd (``registry.WorkerLoad``: ready replicas, waiting and
running requests, KV usage). Each producer keeps raw samples for one interval and hands them
to ``Summary.of``; the observation itself carries only summaries, so its size does not grow
with load and it can be stored, logged and sent as it is.

Summaries rather than raw samples: the planner needs tails (p90) and bursts, not the
individual values, and a fixed-size record can be merged into a decision log and published.
Per-second arrival counts are kept raw (``arrivals_per_s``) because the burst detector needs
their shape within the interval, and an interval holds only ``interval_s`` of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    """Count, mean, median, 90th percentile and maximum of a set of samples."""

    count: int
    mean: float
    p50: float
    p90: float
    max: float

    @staticmethod
    def of(values: Sequence[float], weights: Sequence[float] | None = None) -> Summary | None:
        """Summarise ``values`` (each counted ``weights[i]`` times if given); None when empty.

        Weights let a producer record one value for many equal samples, e.g. one decode step
        whose gap every running request saw: ``values=[step_s], weights=[batch]``.
        """
        if weights is None:
            weights = [1.0] * len(values)
        if len(weights) != len(values):
            raise ValueError(f"{len(values)} values but {len(weights)} weights")
        pairs = sorted((v, w) for v, w in zip(values, weights) if w > 0)
        total = sum(w for _, w in pairs)
        if not pairs:
            return None
        return Summary(
            count=round(total),
            mean=sum(v * w for v, w in pairs) / total,
            p50=_weighted_quantile(pairs, total, 0.5),
            p90=_weighted_quantile(pairs, total, 0.9),
            max=pairs[-1][0],
        )


def _weighted_quantile(pairs: list[tuple[float, float]], total: float, q: float) -> float:
    """The smallest value whose cumulative weight reaches ``q`` of the total (nearest rank)."""
    threshold = q * total
    cumulative = 0.0
    for value, weight in pairs:
        cumulative += weight
        if cumulative >= threshold - 1e-9:
            return value
    return pairs[-1][0]


class Knobs(msgspec.Struct, frozen=True, kw_only=True):
    """Settings that trade TTFT against ITL without changing the number of GPUs.

    - ``decode_max_num_seqs``: most requests a decode worker runs at once; fewer keep each
      decode step short (ITL) while the rest wait for a slot.
    - ``decode_max_num_batched_tokens``: a decode worker's token budget per step; it bounds
      how much of a locally prefilled prompt rides along with the decodes in one step.
    - ``prefill_chunk_size``: a prefill worker's token budget per step (its chunked-prefill
      size); larger batches more prompts per step, amortising the step's fixed cost.
    - ``local_prefill_threshold_tokens``: the router prefills prompts shorter than this on
      the decode worker itself, skipping the prefill queue and the KV transfer; 0 sends
      every prompt to the prefill pool.
    """

    decode_max_num_seqs: int = 64
    decode_max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 2048
    local_prefill_threshold_tokens: int = 0

    def __post_init__(self) -> None:
        if self.decode_max_num_seqs < 1:
            raise ValueError(f"decode_max_num_seqs must be >= 1, got {self.decode_max_num_seqs}")
        if self.decode_max_num_batched_tokens < self.decode_max_num_seqs:
            raise ValueError(
                f"decode_max_num_batched_tokens ({self.decode_max_num_batched_tokens}) must be >= "
                f"decode_max_num_seqs ({self.decode_max_num_seqs}) so every running decode fits a step"
            )
        if self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {self.prefill_chunk_size}")
        if self.local_prefill_threshold_tokens < 0:
            raise ValueError(f"local_prefill_threshold_tokens must be >= 0, got {self.local_prefill_threshold_tokens}")


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

    @property
    def num_arrivals(self) -> int:
        return sum(self.arrivals_per_s)

    @property
    def arrival_rate(self) -> float:
        """Mean arrivals per second over the interval."""
        return self.num_arrivals / self.interval_s
