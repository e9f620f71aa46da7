"""Replay a trace through the simulated cluster under a scaling policy, interval by interval.

Each interval the simulator builds the ``Observation`` a real deployment would produce (the
frontend's latency samples, the workers' load, per-second arrivals), hands it to the policy
(a ``Planner``, a baseline rule, or none for a static allocation) and applies the returned
``Decision``. It also records, per interval, what the policy cannot see: the true p90
latencies including requests not yet done, so that a stalled pool fails its interval
instead of reporting nothing (a request still waiting for its first token past the TTFT
target counts at its age; one still decoding counts at the lower bound of its mean gap,
time since its first token over all its gaps, once that exceeds the ITL target), and the
GPUs held (starting, ready and draining replicas alike, time-averaged).

An interval meets the SLO when its TTFT p90 and ITL p90 are both within target (an interval
without samples of one kind meets that half). Attainment is the fraction of intervals after
the warm-up that meet it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.discovery.knobs import Knobs
from pdserve.discovery.slo import SLOTargets
from pdserve.observability.summary import Summary
from pdserve.planner.observation import Observation
from pdserve.planner.planner import Decision
from pdserve.planner.profile import EngineProfile
from sim.cluster import Cluster, ClusterConfig, Samples
from sim.traces import Trace


class Policy(Protocol):
    def observe(self, obs: Observation) -> Decision | None: ...


@dataclass(frozen=True)
class IntervalRecord:
    time: float  # end of the interval
    arrival_rate: float
    ttft_p90_s: float | None  # true p90, waiting requests included
    itl_p90_s: float | None
    e2e_p90_s: float | None  # of the requests that finished in the interval
    prefill_gpus: float  # GPUs held (replicas x their ranks), averaged over the interval
    decode_gpus: float
    prefill_ready: int
    decode_ready: int
    slo_met: bool


@dataclass
class SimResult:
    trace: str
    interval_s: float
    intervals: list[IntervalRecord] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)

    def attainment(self, warmup_intervals: int) -> float:
        """Fraction of the intervals after ``warmup_intervals`` that met both targets."""
        scored = self.intervals[warmup_intervals:]
        return sum(r.slo_met for r in scored) / len(scored)

    def gpu_intervals(self, warmup_intervals: int) -> float:
        """GPU-intervals held after ``warmup_intervals`` (one GPU held for one interval = 1)."""
        return sum(r.prefill_gpus + r.decode_gpus for r in self.intervals[warmup_intervals:])


def simulate(
    profile: EngineProfile,
    trace: Trace,
    slo: SLOTargets,
    policy: Policy | None,
    *,
    prefill: int,
    decode: int,
    knobs: Knobs = Knobs(),
    interval_s: int = 10,
    config: ClusterConfig = ClusterConfig(),
    seed: int = 0,
) -> SimResult:
    """Run ``trace`` starting from ``prefill`` / ``decode`` ready replicas; ``policy`` None
    keeps them fixed."""
    if interval_s < 1 or interval_s != int(interval_s):
        raise ValueError(f"interval_s must be a whole number of seconds >= 1, got {interval_s}")
    cluster = Cluster(profile, config, knobs, prefill=prefill, decode=decode)
    requests = trace.requests(seed)
    result = SimResult(trace.name, interval_s)
    next_request = 0
    for k in range(math.ceil(trace.duration_s / interval_s)):
        start = k * interval_s
        arrivals_per_s, prompts, running, kv_usage = [], [], [], []
        for second in range(start + 1, start + interval_s + 1):
            count = 0
            while next_request < len(requests) and requests[next_request].arrival_s < second:
                spec = requests[next_request]
                cluster.run_until(spec.arrival_s)
                cluster.arrive(spec)
                prompts.append(spec.prompt_tokens)
                next_request += 1
                count += 1
            cluster.run_until(second)
            arrivals_per_s.append(count)
            ready = [w for w in cluster.decode_workers if w.is_ready(cluster.now)]
            running.append(sum(w.num_decoding for w in ready) / max(len(ready), 1))
            kv_usage.append(sum(w.kv_reserved for w in ready) / max(len(ready), 1) / profile.kv_capacity_tokens)
        samples, cluster.samples = cluster.samples, Samples()
        num_prefill_ready, num_decode_ready = cluster.ready_count()
        obs = Observation(
            model=slo.model,
            time=cluster.now,
            interval_s=interval_s,
            arrivals_per_s=arrivals_per_s,
            prompt_tokens=Summary.of(prompts),
            output_tokens=Summary.of(samples.outputs),
            ttft_s=Summary.of(samples.ttft),
            itl_s=Summary.of(samples.itl),
            e2e_s=Summary.of(samples.e2e),
            num_prefill_ready=num_prefill_ready,
            num_decode_ready=num_decode_ready,
            prefill_waiting=len(cluster.prefill_queue),
            decode_running=sum(running) / interval_s,
            decode_kv_usage=sum(kv_usage) / interval_s,
            knobs=cluster.knobs,
        )
        result.intervals.append(_record(cluster, samples, slo, obs, start))
        decision = policy.observe(obs) if policy is not None else None
        if decision is not None:
            result.decisions.append(decision)
            cluster.knobs = decision.knobs
            cluster.scale(decision.prefill_replicas, decision.decode_replicas)
    return result


def _record(cluster: Cluster, samples: Samples, slo: SLOTargets, obs: Observation, start: float) -> IntervalRecord:
    now = cluster.now
    # Requests still waiting past the target count at their age so far.
    ttft, itl = list(samples.ttft), list(samples.itl)
    for request in cluster.waiting_for_first_token():
        if now - request.spec.arrival_s > slo.ttft_p90_s:
            ttft.append(now - request.spec.arrival_s)
    for request in cluster.decoding():
        # A lower bound of its mean gap: the time since its first token over all its gaps.
        so_far = (now - request.first_token_s) / (request.spec.output_tokens - 1)
        if so_far > slo.itl_p90_s:
            itl.append(so_far)
    ttft_summary, itl_summary = Summary.of(ttft), Summary.of(itl)
    ttft_p90 = ttft_summary.p90 if ttft_summary else None
    itl_p90 = itl_summary.p90 if itl_summary else None

    def gpus(workers: list, ranks: int) -> float:
        held = 0.0
        for w in workers:
            end = now if w.gone_s is None else w.gone_s
            held += max(0.0, min(end, now) - max(w.requested_s, start))
        return ranks * held / (now - start)

    return IntervalRecord(
        time=now,
        arrival_rate=obs.arrival_rate,
        ttft_p90_s=ttft_p90,
        itl_p90_s=itl_p90,
        e2e_p90_s=obs.e2e_s.p90 if obs.e2e_s is not None else None,
        prefill_gpus=gpus(cluster.prefill_workers, cluster.config.prefill_ranks),
        decode_gpus=gpus(cluster.decode_workers, cluster.config.decode_ranks),
        prefill_ready=obs.num_prefill_ready,
        decode_ready=obs.num_decode_ready,
        slo_met=(ttft_p90 is None or ttft_p90 <= slo.ttft_p90_s) and (itl_p90 is None or itl_p90 <= slo.itl_p90_s),
    )
