"""Request traces for the simulator: Poisson arrivals in segments of constant rate and lengths.

A trace is a list of segments; each has a mean arrival rate and lognormal prompt and output
lengths (given by their medians, with the trace's spreads). ``requests(seed)`` draws the
arrivals and lengths with a seeded generator, so a trace replays identically. The six
standard shapes the planner is validated on:

- ``steady``: one rate throughout.
- ``step``: the load steps up by ``factor`` for the middle third, then back down.
- ``burst``: short spikes of ``factor`` x the rate, every ``every_s`` seconds in the middle
  third (a busy hour), on top of the base rate.
- ``length_shift``: the same rate, but prompts grow ``factor`` x longer in the middle third.
- ``diurnal``: the rate follows one cosine day from ``rate`` up to ``factor`` x and back,
  in ``step_s`` segments.
- ``long_mix``: the same rate, but in the middle third ``long_fraction`` of the prompts
  come from a second population ``factor`` x longer (a long-document tenant joins).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    duration_s: float
    rate: float  # mean arrivals per second
    prompt_median: float  # tokens
    output_median: float  # tokens
    long_fraction: float = 0.0  # of prompts drawn around long_prompt_median instead
    long_prompt_median: float = 0.0


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Trace:
    name: str
    segments: tuple[Segment, ...]
    prompt_sigma: float = 0.6  # of log(tokens): p90 is about 2.2x the median
    output_sigma: float = 0.5
    max_prompt_tokens: int = 2000  # lengths are clipped to what the profiled model holds
    max_output_tokens: int = 1000

    @property
    def duration_s(self) -> float:
        return sum(s.duration_s for s in self.segments)

    def requests(self, seed: int = 0) -> list[TraceRequest]:
        """Every request of the trace, in arrival order."""
        rng = random.Random(f"{self.name}-{seed}")
        out: list[TraceRequest] = []
        start = 0.0
        for segment in self.segments:
            t, end = start, start + segment.duration_s
            while segment.rate > 0:
                t += rng.expovariate(segment.rate)
                if t >= end:
                    break
                median = segment.prompt_median
                if segment.long_fraction and rng.random() < segment.long_fraction:
                    median = segment.long_prompt_median
                prompt = _lognormal(rng, median, self.prompt_sigma, self.max_prompt_tokens)
                output = _lognormal(rng, segment.output_median, self.output_sigma, self.max_output_tokens)
                out.append(TraceRequest(t, prompt, output))
            start = end
        return out


def _lognormal(rng: random.Random, median: float, sigma: float, maximum: int) -> int:
    return min(max(1, round(median * math.exp(rng.gauss(0.0, sigma)))), maximum)


def steady(rate: float, prompt: float, output: float, duration_s: float) -> Trace:
    return Trace("steady", (Segment(duration_s, rate, prompt, output),))


def step(rate: float, prompt: float, output: float, duration_s: float, factor: float = 3.0) -> Trace:
    third = duration_s / 3
    return Trace(
        "step",
        (
            Segment(third, rate, prompt, output),
            Segment(third, rate * factor, prompt, output),
            Segment(third, rate, prompt, output),
        ),
    )


def burst(
    rate: float,
    prompt: float,
    output: float,
    duration_s: float,
    factor: float = 3.0,
    burst_s: float = 20.0,
    every_s: float = 120.0,
) -> Trace:
    third = duration_s / 3
    segments = [Segment(third, rate, prompt, output)]
    for _ in range(int(third // every_s)):
        segments.append(Segment(burst_s, rate * factor, prompt, output))
        segments.append(Segment(every_s - burst_s, rate, prompt, output))
    segments.append(Segment(duration_s - sum(s.duration_s for s in segments), rate, prompt, output))
    return Trace("burst", tuple(segments))


def length_shift(rate: float, prompt: float, output: float, duration_s: float, factor: float = 3.0) -> Trace:
    third = duration_s / 3
    return Trace(
        "length_shift",
        (
            Segment(third, rate, prompt, output),
            Segment(third, rate, prompt * factor, output),
            Segment(third, rate, prompt, output),
        ),
    )


def diurnal(
    rate: float, prompt: float, output: float, duration_s: float, factor: float = 3.0, step_s: float = 30.0
) -> Trace:
    segments = []
    for k in range(math.ceil(duration_s / step_s)):
        length = min(step_s, duration_s - k * step_s)
        middle = (k * step_s + length / 2) / duration_s
        level = rate * (1 + (factor - 1) * (1 - math.cos(2 * math.pi * middle)) / 2)
        segments.append(Segment(length, level, prompt, output))
    return Trace("diurnal", tuple(segments))


def long_mix(
    rate: float, prompt: float, output: float, duration_s: float, factor: float = 4.0, long_fraction: float = 0.3
) -> Trace:
    third = duration_s / 3
    return Trace(
        "long_mix",
        (
            Segment(third, rate, prompt, output),
            Segment(third, rate, prompt, output, long_fraction, prompt * factor),
            Segment(third, rate, prompt, output),
        ),
    )


def standard_traces(rate: float, prompt: float, output: float, duration_s: float) -> list[Trace]:
    """The six shapes, at base ``rate`` req/s with median ``prompt`` / ``output`` tokens."""
    return [
        steady(rate, prompt, output, duration_s),
        diurnal(rate, prompt, output, duration_s),
        step(rate, prompt, output, duration_s),
        burst(rate, prompt, output, duration_s),
        length_shift(rate, prompt, output, duration_s),
        long_mix(rate, prompt, output, duration_s),
    ]
