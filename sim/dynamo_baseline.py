"""A Dynamo-style SLA planner, re-implemented from NVIDIA Dynamo's documented algorithm, as a
simulator policy to measure pdserve's planner against.

Not Dynamo's code: its throughput-based scaling as its planner design documents describe it
(``planner_core.py``, ``make_adjustments``), step for step. Every ``adjustment_interval`` (the
simulator's interval), from the interval's averages (mean TTFT, ITL, prompt and output
length, request duration, request count):

1. correction factors: ``p_correction = mean TTFT / profiled TTFT at the mean prompt`` and
   ``d_correction = mean ITL / profiled ITL at the observed concurrency and context``;
2. a load forecast for the next interval: Dynamo's constant predictor (next = last), the
   simplest of its documented predictors (constant, ARIMA, Prophet);
3. replicas = ceil(load / profiled capacity per replica), per pool: prefill load is
   ``requests x mean prompt / interval x min(1, p_correction)`` tokens/s over the profiled
   prefill throughput at the mean prompt; decode load is ``requests x mean output /
   interval`` tokens/s over the best profiled decode throughput per replica whose step
   holds ``ITL target / d_correction`` at context ``mean prompt + mean output / 2``
   (batches up to the deployment's cap);
4. clamp to the replica bounds; skip the interval when a metric is missing.

It never retunes knobs, and it sizes on what is requested, Pending replicas included.
"""

from __future__ import annotations

import math

from pdserve.discovery.knobs import Knobs
from pdserve.discovery.slo import SLOTargets
from pdserve.planner.observation import Observation
from pdserve.planner.planner import Decision
from pdserve.planner.profile import EngineProfile


class DynamoBaseline:
    """The policy above; ``prefill`` and ``decode`` are the sizes in force (set them to the
    starting allocation)."""

    def __init__(self, slo: SLOTargets, profile: EngineProfile, knobs: Knobs, interval_s: float) -> None:
        self.slo, self.profile, self.knobs, self.interval_s = slo, profile, knobs, interval_s
        self.prefill = self.decode = 0

    def observe(self, obs: Observation) -> Decision | None:
        if (
            obs.ttft_s is None
            or obs.itl_s is None
            or obs.e2e_s is None
            or obs.prompt_tokens is None
            or obs.output_tokens is None
        ):
            return None
        slo, profile = self.slo, self.profile
        isl, osl, requests = obs.prompt_tokens.mean, obs.output_tokens.mean, obs.num_arrivals
        context = isl + osl / 2
        p_correction = obs.ttft_s.mean / profile.prefill_seconds(isl)
        concurrency = requests / max(obs.num_decode_ready, 1) * obs.e2e_s.mean / self.interval_s
        expected_itl = profile.decode_step_seconds(max(concurrency, 1.0), max(concurrency, 1.0) * context)
        d_correction = obs.itl_s.mean / expected_itl
        prefill_load = requests * isl / self.interval_s * min(1.0, p_correction)
        prefill = math.ceil(prefill_load / profile.prefill_tokens_per_s(isl))
        corrected_itl = slo.itl_p90_s / d_correction if d_correction > 0 else slo.itl_p90_s
        decode = math.ceil(requests * osl / self.interval_s / self._best_decode_throughput(corrected_itl, context))
        prefill = min(max(prefill, slo.min_prefill_replicas), slo.max_prefill_replicas)
        decode = min(max(decode, slo.min_decode_replicas), slo.max_decode_replicas)
        if (prefill, decode) == (self.prefill, self.decode):
            return None
        self.prefill, self.decode = prefill, decode
        return Decision(
            model=slo.model,
            time=obs.time,
            prefill_replicas=prefill,
            decode_replicas=decode,
            knobs=self.knobs,
            reasons=[f"dynamo-style: {requests} requests, prompt {isl:.0f}, output {osl:.0f} tokens"],
            rate=obs.arrival_rate,
            peak_rate=obs.arrival_rate,
            predicted_ttft_p90_s=None,
            predicted_itl_p90_s=None,
        )

    def _best_decode_throughput(self, itl_s: float, context: float) -> float:
        """Tokens/s of one replica at the largest batch whose step holds ``itl_s`` (Dynamo's
        ``find_best_throughput_per_gpu``: the highest KV load under the ITL, else the lowest)."""
        profile = self.profile
        best = 1
        for batch in range(1, min(profile.max_num_seqs, self.knobs.decode_max_num_seqs) + 1):
            if batch * context > profile.kv_capacity_tokens:
                break
            if profile.decode_step_seconds(batch, batch * context) <= itl_s:
                best = batch
        return best / profile.decode_step_seconds(best, best * context)
