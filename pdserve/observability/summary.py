"""A fixed-size summary of a set of samples: what producers publish instead of raw values.

The planner needs tails (p90) and bursts, not individual values, and a fixed-size record can be
stored in etcd, merged into a decision log and published as it is.
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
