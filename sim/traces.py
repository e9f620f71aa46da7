"""Request traces for the simulator: Poisson arrivals in segments of constant rate and lengths.

A trace is a list of segments; each has a mean arrival rate and lognormal prompt and output
lengths (given by their medians, with the trace's spreads). ``requests(seed)`` draws the
arrivals and lengths with a seeded generator, so a trace replays identically. The four
standard shapes the planner is validated on:

- ``steady``: one rate throughout.
- ``step``: the load steps up by ``factor`` for the middle third, then back down.
- ``burst``: short spikes of ``factor`` x the rate, every ``every_s`` seconds in the middle
  third (a busy hour), on top of the base rate.
- ``length_shift``: the same rate, but prompts grow ``factor`` x longer in the middle third.
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
                prompt = _lognormal(rng, segment.prompt_median, self.prompt_sigma, self.max_prompt_tokens)
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


def standard_traces(rate: float, prompt: float, output: float, duration_s: float) -> list[Trace]:
    """The four shapes, at base ``rate`` req/s with median ``prompt`` / ``output`` tokens."""
    return [
        steady(rate, prompt, output, duration_s),
        step(rate, prompt, output, duration_s),
        burst(rate, prompt, output, duration_s),
        length_shift(rate, prompt, output, duration_s),
    ]
