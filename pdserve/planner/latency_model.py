"""Predicted TTFT and ITL percentiles of a pool of ``n`` replicas under a forecast load.

The planner asks "what would the p90 be with n replicas?" for each candidate n;
``LatencyModel`` answers from the engine's profile and queueing, never from averages alone:

- Lengths are lognormal, fitted to the forecast p50 and p90: a long tail of prompts costs
  more prefill time than the mean prompt suggests.
- Prefill is replayed: 2,000 Poisson arrivals with lognormal prompts through ``n`` workers
  that each batch up to ``prefill_chunk_size`` tokens a step, first come first served, as
  the prefill workers do (a closed form for M/G/c missed the batching: a prompt waits for
  its whole batch's step). TTFT's p90 is read as the waiting time's ``wait_quantile`` plus
  the time in service's p90 (see ``_simulate_prefill`` for why). The same random numbers
  serve every prediction, so predictions move smoothly with the load and the size, and
  they are cached. Prompts shorter than the local-prefill threshold leave the queue.
- Decode is continuous batching: Little's law ``B = (rate / n) * output_tokens * step(B)``
  gives the mean batch per replica (fixed-point iteration, since the step grows with the
  batch). The batch is Poisson around it; ITL, a request's mean gap between tokens, is the
  step at the batch's p90, plus the p90 wait for one of the ``decode_max_num_seqs`` slots
  (Erlang C over the slots of all replicas, which the least-loaded router pools) spread
  over the request's gaps. Local prefills take their share of a replica's time and add
  their chunk to the p90 step once more than a tenth of the steps carry one. A batch that
  cannot stay under the slot cap or the KV cache is unbounded.

Predictions are ``math.inf`` for a load the pool cannot carry.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import NormalDist

from pdserve.discovery.knobs import Knobs
from pdserve.planner.forecast import LengthForecast
from pdserve.planner.profile import EngineProfile

_Z90 = NormalDist().inv_cdf(0.9)
_GRID = 24  # quantiles per length distribution
_MAX_UTILISATION = 0.98  # beyond this the queueing formulas say "fine" right up to the cliff
_KV_HEADROOM = 0.9  # preemptions start before the last block is used
_SIMULATED_PROMPTS = 2000  # per prefill prediction: enough for a stable p90, ~10 ms


def _bucket(value: float) -> float:
    """``value`` to about 1%, so that near-equal forecasts share a cached prediction."""
    return round(math.log(value), 2) if value > 0 else -math.inf


@dataclass(frozen=True)
class LengthDistribution:
    """Lognormal token lengths with the given median and 90th percentile."""

    p50: float
    p90: float

    @staticmethod
    def of(forecast: LengthForecast) -> LengthDistribution:
        p50 = max(forecast.p50, 1.0)
        return LengthDistribution(p50=p50, p90=max(forecast.p90, p50))

    @property
    def sigma(self) -> float:
        return math.log(self.p90 / self.p50) / _Z90

    def fraction_below(self, tokens: float) -> float:
        if tokens <= 0:
            return 0.0
        if self.sigma == 0:
            return 1.0 if tokens > self.p50 else 0.0
        return NormalDist().cdf(math.log(tokens / self.p50) / self.sigma)

    def quantiles(self, low: float = 0.0, high: float = 1.0) -> list[float]:
        """Lengths at ``_GRID`` evenly spaced quantiles between ``low`` and ``high``: equally
        likely representatives of that slice of the distribution."""
        normal = NormalDist()
        points = []
        for k in range(_GRID):
            q = min(max(low + (high - low) * (k + 0.5) / _GRID, 1e-6), 1 - 1e-6)
            points.append(self.p50 * math.exp(self.sigma * normal.inv_cdf(q)))
        return points


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with ``offered`` = rate * E[S]."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    blocking = 1.0  # Erlang B, by the stable recurrence
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    return servers * blocking / (servers - offered * (1 - blocking))


@dataclass(frozen=True)
class DecodeLoad:
    """A decode replica's predicted steady state."""

    mean_batch: float  # requests decoding at once, on average
    p90_batch: float  # the batch a token sees at its 90th percentile
    context_per_seq: float  # mean context tokens of a decoding request
    slot_wait_p90_s: float  # wait for one of the decode_max_num_seqs slots, at its p90
    local_per_s: float  # prompts prefilled locally per second
    local_chunk: float  # tokens of a local prompt's prefill that ride in one step


class LatencyModel:
    """Predicts one model's latencies from its engine profile; keeps a cache of the
    simulated prefill queues (the planner asks about the same few sizes every interval)."""

    def __init__(self, profile: EngineProfile, wait_quantile: float = 0.97, seed: int = 0) -> None:
        self.profile = profile
        self.wait_quantile = wait_quantile
        rng = random.Random(seed)
        # Common random numbers: every prediction replays the same arrivals and lengths,
        # rescaled, so predictions move smoothly with the rate, the lengths and the size.
        self._gaps = [rng.expovariate(1.0) for _ in range(_SIMULATED_PROMPTS)]
        self._quantiles = [rng.random() for _ in range(_SIMULATED_PROMPTS)]
        self._cache: dict[tuple, float] = {}

    def ttft_p90(self, replicas: int, rate: float, prompt: LengthForecast, knobs: Knobs) -> float:
        """Predicted TTFT p90 (seconds) with ``replicas`` prefill workers at ``rate`` requests/s."""
        lengths = LengthDistribution.of(prompt)
        local = lengths.fraction_below(knobs.local_prefill_threshold_tokens)
        if local >= 1.0 or rate <= 0:
            return 0.0
        # Prompts the decode workers prefill come back within about a decode step, far under
        # any TTFT target, so the overall p90 is the remote prompts' quantile at a tail of
        # 0.1 / (1 - local).
        remote = rate * (1 - local)
        mean_service = _mean(_prefill_service(self.profile, n, knobs) for n in lengths.quantiles(local, 1.0))
        if remote * mean_service >= replicas * _MAX_UTILISATION:
            return math.inf
        key = (replicas, _bucket(remote), _bucket(lengths.p50), _bucket(lengths.p90), knobs.prefill_chunk_size, local)
        if key not in self._cache:
            self._cache[key] = self._simulate_prefill(replicas, remote, lengths, local, knobs.prefill_chunk_size)
        return self._cache[key]

    def _simulate_prefill(
        self, replicas: int, rate: float, lengths: LengthDistribution, local: float, chunk: int
    ) -> float:
        """TTFT's p90 from a replay of the prefill pool (FCFS queue, each free worker batching
        up to ``chunk`` tokens a step, the last prompt in part), as the waiting time's
        ``wait_quantile`` plus the time in service's p90.

        The two parts are taken at different quantiles because they vary on different
        scales: the service time varies from prompt to prompt within every interval, while a
        queue, once formed, spans intervals. The p90 of an interval therefore moves with the
        waiting time, and holding it in nearly every interval needs the waiting time's tail.
        """
        normal = NormalDist()
        arrivals, t = [], 0.0
        for gap in self._gaps:
            t += gap / rate
            arrivals.append(t)
        tokens = [
            max(
                1, round(lengths.p50 * math.exp(lengths.sigma * normal.inv_cdf(min(local + (1 - local) * q, 1 - 1e-9))))
            )
            for q in self._quantiles
        ]
        waits: list[float] = []
        services: list[float] = []
        started = [0.0] * len(tokens)
        queue: deque[int] = deque()
        left = list(tokens)  # tokens still to compute, per prompt
        carry: list[int | None] = [None] * replicas  # the prompt a worker has started
        busy: list[tuple[float, int, list[int]]] = []  # (free at, worker, prompts it finishes)
        idle = list(range(replicas))

        def start_step(worker: int, now: float) -> None:
            budget, done = chunk, list[int]()
            while budget > 0 and (carry[worker] is not None or queue):
                i = carry[worker]
                if i is None:
                    i = queue.popleft()
                    started[i] = now
                take = min(left[i], budget)
                left[i] -= take
                budget -= take
                carry[worker] = i if left[i] else None
                if not left[i]:
                    done.append(i)
            if budget == chunk:
                idle.append(worker)
            else:
                heapq.heappush(busy, (now + self.profile.prefill_seconds(chunk - budget), worker, done))

        next_arrival = 0
        while next_arrival < len(arrivals) or busy:
            if next_arrival < len(arrivals) and (not busy or arrivals[next_arrival] <= busy[0][0]):
                now = arrivals[next_arrival]
                queue.append(next_arrival)
                next_arrival += 1
                while idle and queue:
                    start_step(idle.pop(), now)
            else:
                now, worker, done = heapq.heappop(busy)
                for i in done:
                    if i >= len(tokens) // 10:  # the first tenth starts from an empty pool
                        waits.append(started[i] - arrivals[i])
                        services.append(now - started[i])
                start_step(worker, now)
        return _quantile(waits, 1 - (1 - self.wait_quantile) / (1 - local)) + _quantile(services, 1 - 0.1 / (1 - local))

    def decode_load(
        self, replicas: int, rate: float, prompt: LengthForecast, output: LengthForecast, knobs: Knobs
    ) -> DecodeLoad | None:
        """The steady batch per decode replica, or None when it grows without bound or
        outgrows the KV cache."""
        profile = self.profile
        per_replica = rate / replicas
        tokens = max(output.mean, 1.0)
        context = prompt.mean + tokens / 2
        cap = min(knobs.decode_max_num_seqs, profile.max_num_seqs)
        lengths = LengthDistribution.of(prompt)
        local = lengths.fraction_below(knobs.local_prefill_threshold_tokens)
        local_per_s = per_replica * local
        # Local prefills take this share of the replica's time away from decoding.
        busy = local_per_s * _mean(map(profile.prefill_seconds, lengths.quantiles(0.0, local))) if local else 0.0
        if busy >= _MAX_UTILISATION:
            return None
        batch = 0.0
        for _ in range(200):
            step = profile.decode_step_seconds(max(batch, 1.0), max(batch, 1.0) * context) / (1 - busy)
            following = per_replica * tokens * step
            if following > cap:
                return None
            if abs(following - batch) < 1e-3:
                break
            batch = following
        else:
            return None  # still growing: no fixed point below the cap
        # A request holds one of ``cap`` slots for its whole decode (Little: ``batch`` busy on
        # average): an M/M/c queue for slots, whose wait is the request's first gap.
        if batch > cap * _MAX_UTILISATION:
            return None
        # The router sends each request to the least-loaded replica, so the slots of all
        # replicas act as one pool: ``cap * replicas`` servers.
        holding_s = tokens * step
        slots, busy_slots = cap * replicas, batch * replicas
        waits = erlang_c(slots, busy_slots)
        slot_wait = math.log(waits / 0.1) * holding_s / (slots - busy_slots) if waits > 0.1 else 0.0
        # A request's mean gap averages the steps of its whole decode; the batch it sees is
        # Poisson around the mean, taken at its p90.
        p90_batch = min(batch + _Z90 * math.sqrt(batch), cap)
        if p90_batch * context > profile.kv_capacity_tokens * _KV_HEADROOM:
            return None
        chunk = min(knobs.local_prefill_threshold_tokens, max(knobs.decode_max_num_batched_tokens - p90_batch, 1.0))
        return DecodeLoad(batch, p90_batch, context, slot_wait, local_per_s, chunk)

    def itl_p90(
        self, replicas: int, rate: float, prompt: LengthForecast, output: LengthForecast, knobs: Knobs
    ) -> float:
        """Predicted p90 over requests of their mean inter-token gap (seconds) with ``replicas``
        decode workers at ``rate`` requests/s: the step at the p90 batch, plus a p90 wait for
        a decode slot spread over the request's gaps."""
        load = self.decode_load(replicas, rate, prompt, output, knobs)
        if load is None:
            return math.inf
        step = self.profile.decode_step_seconds(load.p90_batch, load.p90_batch * load.context_per_seq)
        step += load.slot_wait_p90_s / max(output.mean - 1, 1.0)
        # A local prompt's chunk rides in a step: once more than a tenth of the steps carry
        # one, the p90 token waits for a chunk too.
        if load.local_per_s * step > 0.1:
            step += self.profile.prefill_seconds(load.local_chunk)
        return step

    def prefill_capacity(self, prompt: LengthForecast, knobs: Knobs) -> float:
        """Requests/s one prefill replica computes, back to back."""
        lengths = LengthDistribution.of(prompt)
        return 1 / _mean(_prefill_service(self.profile, n, knobs) for n in lengths.quantiles())

    def largest_batch_within(self, step_s: float, context_per_seq: float) -> int:
        """The largest batch (at least 1) whose decode step at this context takes <= ``step_s``."""
        fits = [
            b
            for b in range(1, self.profile.max_num_seqs + 1)
            if self.profile.decode_step_seconds(b, b * context_per_seq) <= step_s
        ]
        return fits[-1] if fits else 1


def _prefill_service(profile: EngineProfile, tokens: float, knobs: Knobs) -> float:
    """Seconds a prefill worker spends on one prompt, in chunks of ``prefill_chunk_size``."""
    full, rest = divmod(tokens, knobs.prefill_chunk_size)
    return full * profile.prefill_seconds(knobs.prefill_chunk_size) + profile.prefill_seconds(rest)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(max(int(len(ordered) * q), 0), len(ordered) - 1)]


def _mean(values: Iterable[float]) -> float:
    items = list(values)
    return sum(items) / len(items)
