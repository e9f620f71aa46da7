"""Predict the next interval's load from the observed ones: arrival rate, bursts, lengths.

Three signals, each built to err towards more capacity when traffic rises and to let go of
it only slowly:

- ``rate``: the larger of the last interval's mean rate and a fast EWMA of the interval
  means, so a load step is seen at once and a drop only after it has lasted.
- ``peak_rate``: what the pools must absorb for the TTFT and ITL percentiles to hold through
  bursts that are shorter than the time a new replica needs to start. Each interval's
  arrivals are cut into ``burst_bin_s`` bins; a bin is elevated when its count exceeds the
  slow baseline rate by more than Poisson noise (``burst_z`` standard deviations). A run of
  elevated intervals that ends within ``burst_max_s`` was a burst: its peak is remembered
  for ``burst_memory_s``, because bursts recur and capacity that arrives after a burst has
  ended is wasted, so it is held while bursts keep coming. A run that lasts longer is a new
  load level, which ``rate`` follows; it leaves nothing to remember when it ends.
- prompt and output lengths: mean, p50 and p90, each the larger of the latest value and its
  EWMA, so a shift to longer prompts is planned for at once (output lengths, known only
  at a request's end and biased short while load rises, on the slow EWMA).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.observability.summary import Summary
from pdserve.planner.observation import Observation


@dataclass(frozen=True)
class ForecastConfig:
    fast_alpha: float = 0.4  # EWMA weight of the newest interval for rate and lengths
    slow_alpha: float = 0.1  # EWMA weight for the baseline that bursts are measured against
    burst_bin_s: int = 5
    burst_z: float = 4.0  # a false alarm among the 5 s bins of a burst memory is then rare
    burst_max_s: float = 60.0
    burst_memory_s: float = 300.0  # bursts that recur within it keep their capacity

    def __post_init__(self) -> None:
        for name in ("fast_alpha", "slow_alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.burst_bin_s < 1:
            raise ValueError(f"burst_bin_s must be >= 1, got {self.burst_bin_s}")
        if self.burst_z < 0 or self.burst_max_s < 0 or self.burst_memory_s < 0:
            raise ValueError("burst_z, burst_max_s and burst_memory_s must be >= 0")


@dataclass(frozen=True)
class LengthForecast:
    """Predicted token lengths of requests (prompt or output)."""

    mean: float
    p50: float
    p90: float


@dataclass(frozen=True)
class Forecast:
    rate: float  # requests/s expected over the next interval
    peak_rate: float  # requests/s to size the pools for: >= rate, bursts included
    prompt_tokens: LengthForecast
    output_tokens: LengthForecast


def ewma(previous: float | None, value: float, alpha: float) -> float:
    """Exponentially weighted moving average; the first value starts it."""
    return value if previous is None else alpha * value + (1 - alpha) * previous


def burst_rates(counts: Sequence[int], bin_s: int, baseline_rate: float, z: float) -> list[float]:
    """Rates (req/s) of the ``bin_s``-second bins of ``counts`` (arrivals per second) whose
    count exceeds ``baseline_rate`` by more than ``z`` Poisson standard deviations.

    A trailing partial bin is judged on its own length.
    """
    rates = []
    for start in range(0, len(counts), bin_s):
        arrivals = sum(counts[start : start + bin_s])
        seconds = len(counts[start : start + bin_s])
        expected = baseline_rate * seconds
        if arrivals > expected + z * math.sqrt(max(expected, 1.0)):
            rates.append(arrivals / seconds)
    return rates


class Forecaster:
    """Keeps the history one model's forecast needs; ``update`` once per interval."""

    def __init__(self, config: ForecastConfig = ForecastConfig()) -> None:
        self.config = config
        self._fast_rate: float | None = None
        self._slow_rate: float | None = None
        self._bursts: deque[tuple[float, float]] = deque()  # (time seen, rate), oldest first
        self._run_start: float | None = None  # when the current run of elevated intervals began
        self._run_peak = 0.0
        self._prompt = _LengthTracker(config.fast_alpha)
        # Output lengths are known only when requests finish, and when load rises the short
        # ones finish first: a fast average would follow that bias down, so it moves slowly.
        self._output = _LengthTracker(config.slow_alpha)

    def update(self, obs: Observation) -> Forecast:
        """Fold in ``obs`` and predict the next interval."""
        cfg = self.config
        rate = obs.arrival_rate
        # Bursts stand out against the slow baseline, or the fast one after a drop in load.
        baseline = rate if self._slow_rate is None or self._fast_rate is None else min(self._slow_rate, self._fast_rate)
        elevated = burst_rates(obs.arrivals_per_s, cfg.burst_bin_s, baseline, cfg.burst_z)
        start = obs.time - obs.interval_s
        new_level = False
        if elevated:
            if self._run_start is None:
                self._run_start = start
            self._run_peak = max(self._run_peak, *elevated)
            new_level = obs.time - self._run_start > cfg.burst_max_s
        elif self._run_start is not None:
            self._bursts.append((obs.time, self._run_peak))
        if new_level or not elevated:
            self._run_start, self._run_peak = None, 0.0
        while self._bursts and self._bursts[0][0] < obs.time - cfg.burst_memory_s:
            self._bursts.popleft()
        self._fast_rate = ewma(self._fast_rate, rate, cfg.fast_alpha)
        self._slow_rate = ewma(self._slow_rate, rate, cfg.slow_alpha)
        if new_level:  # the baseline moves there at once, or noise above it would look like bursts
            self._slow_rate = self._fast_rate
        level = max(rate, self._fast_rate)
        peaks = [level] + [burst for _, burst in self._bursts]
        if self._run_start is not None:
            peaks.append(self._run_peak)  # a burst going on now
        return Forecast(
            rate=level,
            peak_rate=max(peaks),
            prompt_tokens=self._prompt.update(obs.prompt_tokens),
            output_tokens=self._output.update(obs.output_tokens),
        )


class _LengthTracker:
    """Larger of latest and EWMA for mean, p50 and p90; holds its value through empty intervals."""

    def __init__(self, alpha: float) -> None:
        self._alpha = alpha
        self._ewma: LengthForecast | None = None
        self._latest = LengthForecast(mean=0.0, p50=0.0, p90=0.0)

    def update(self, summary: Summary | None) -> LengthForecast:
        if summary is not None:
            previous = self._ewma
            self._ewma = LengthForecast(
                mean=ewma(None if previous is None else previous.mean, summary.mean, self._alpha),
                p50=ewma(None if previous is None else previous.p50, summary.p50, self._alpha),
                p90=ewma(None if previous is None else previous.p90, summary.p90, self._alpha),
            )
            self._latest = LengthForecast(mean=summary.mean, p50=summary.p50, p90=summary.p90)
        if self._ewma is None:
            return self._latest
        return LengthForecast(
            mean=max(self._latest.mean, self._ewma.mean),
            p50=max(self._latest.p50, self._ewma.p50),
            p90=max(self._latest.p90, self._ewma.p90),
        )
