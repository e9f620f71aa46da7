"""Helpers every bench's report uses: medians, ratios, percentiles, and printing the report.

Contract: pure functions over plain numbers and dicts; imports nothing but the standard library.
A report goes to stdout as exactly one JSON object (``--json``) or as the bench's own lines.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable
from typing import Any


def median(values: Iterable[float], digits: int | None = None) -> float:
    """The median, rounded to ``digits`` when given."""
    value = statistics.median(values)
    return value if digits is None else round(value, digits)


def ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    """a / b rounded; None when either is missing or b is 0."""
    return round(a / b, digits) if a is not None and b else None


def median_ratio(a: Iterable[float], b: Iterable[float], digits: int = 3) -> float:
    """The median of the pairwise ratios a[i] / b[i] (runs alternated, so pairs shared a machine's state)."""
    return round(statistics.median(x / y for x, y in zip(a, b)), digits)


def percentiles(values: list[float]) -> dict[str, float] | None:
    """p50/p90/p99 (linear interpolation, as numpy's default), mean, max and n; None when empty."""
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        k = (len(ordered) - 1) * q
        low = math.floor(k)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (k - low)

    return {
        "p50": round(at(0.5), 3),
        "p90": round(at(0.9), 3),
        "p99": round(at(0.99), 3),
        "mean": round(statistics.fmean(ordered), 3),
        "max": round(ordered[-1], 3),
        "n": len(ordered),
    }


def nearest_rank(values: list[float], q: float) -> float | None:
    """The sample at rank ``int(q * n)`` of the sorted values (no interpolation); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def emit(
    report: dict[str, Any],
    as_json: bool,
    table: Callable[[dict[str, Any]], None] | None = None,
    *,
    indent: int | None = None,
    width: int = 0,
) -> None:
    """Print ``report``: one JSON object, else ``table(report)``, else a ``key: value`` line each."""
    if as_json:
        print(json.dumps(report, indent=indent))
    elif table is not None:
        table(report)
    else:
        for key, value in report.items():
            print(f"{key:>{width}}: {value}")
