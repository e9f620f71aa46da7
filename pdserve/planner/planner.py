"""The SLO planner: each interval, observe → forecast → predict → decide.

``Planner.observe`` takes one ``Observation`` and returns a ``Decision`` (new pool sizes and
knobs, with the reasons) or None when nothing should change. It is pure bookkeeping: the
caller applies decisions through a ``ScalingConnector`` and publishes them.

Pool sizes. For each pool the planner predicts the p90 latency at a candidate replica count
(``latency_model``) from the engine profile, the forecast peak rate (bursts included), the
forecast length percentiles and the work already queued (prompts waiting for prefill, sized
to drain within ``drain_s``; when a pool must grow, also what will queue during the
``startup_s`` its new replicas take). Margins are taken on what replicas can change: the
distance from the p90 the pool's maximum would reach (the service time itself) to the
target. The planner

- scales up when the prediction at the current size exceeds the target, straight to the
  fewest replicas predicted within ``size_to`` of that distance (at most ``max_step_up``
  more at once);
- scales up by one when the observed p90 breaches the target although the model says it
  should not, once the pool has no replica still starting and ``up_cooldown_intervals``
  have passed since its last scale-up: the model is then wrong, and the observation wins;
- scales down, by at most ``max_shrink`` of the pool, only when the smaller pool is
  predicted within ``scale_down_below`` of the distance at the highest peak of the last
  ``down_cooldown_intervals`` plus ``shrink_headroom``, the observed p90 is within it too,
  and ``down_cooldown_intervals`` have passed since the pool last changed.

The gap between the thresholds, the peak window and headroom, and the cool-down after
every change keep the pools from flapping on noise; bursts are held by the forecast's
burst memory rather than chased.

Hysteresis and cool-downs, as defaults (``PlannerConfig``, 10 s intervals): up fast, down
slowly. A predicted breach scales up at once; an observed one after ``up_cooldown_intervals``
(2) since the last scale-up. A shrink waits ``down_cooldown_intervals`` (6) after any change
of the pool and is judged at the peak of that window. A scale-up within
``flap_window_intervals`` (30) of a shrink that itself came within that window of a scale-up
(up, down, up: the pool flaps) doubles the pool's down cool-down and peak window, once per
such reversal, up to ``max_down_cooldown_intervals`` (36); a shrink more than the flap window
after the last scale-up resets it. So a load that swings faster than the cool-down holds its
peak capacity, while one step of the load up and back down is followed at the usual pace.

Failure modes the planner guards against:

- cold-start samples: for ``cold_start_intervals`` (2) after a pool's ready count rises (at
  start-up too), its observed latency alone scales nothing (a warming replica's first
  requests are slow); predictions from the load still do;
- Pending replicas (requested, not ready): no observed breach adds to a pool that has any,
  and no decision puts more than ``max_pending`` (16) requested-but-not-ready replicas in a
  pool, so replicas that never start are not piled on;
- missing metrics: an interval no frontend reported (``traffic_observed`` False) changes
  nothing and feeds nothing to the forecast: unknown traffic is not zero traffic.

Knobs, the levers that need no new hardware:

- ``decode_max_num_seqs`` is capped at the largest batch whose decode step, at the forecast
  context, stays within ``size_to`` x the ITL target: a bigger batch can only break ITL, and
  on a backend whose step grows faster than the batch it also lowers throughput, which turns
  a burst into a collapse. The decode pool is then sized for slots, not for step time.
- TTFT infeasible at the prefill maximum: ``local_prefill_threshold_tokens`` rises to the
  smallest length (a quantile of the prompt distribution, no longer than a prefill that
  fits in one ITL target) that makes TTFT feasible while ITL stays feasible at the decode
  maximum: short prompts then skip the prefill queue, and the decode pool, sized with the
  new knob, absorbs them. When prompts outgrow ``prefill_chunk_size`` it is raised to cover
  the p90 prompt, saving a step's fixed cost per chunk.
- ITL infeasible at the decode maximum: prompts stop being prefilled locally. While some
  are and ITL is within the target but not within ``size_to`` of it, the decode token
  budget shrinks so that their chunks stay short.

Tightening a knob applies at once; loosening waits ``down_cooldown_intervals``. Min and max
replicas are respected in every decision. Every decision is logged with its reasons.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from msgspec.structs import replace

from pdserve.discovery.knobs import Knobs
from pdserve.discovery.registry import Role
from pdserve.discovery.slo import SLOTargets
from pdserve.planner.config import PlannerConfig
from pdserve.planner.forecast import Forecast, Forecaster
from pdserve.planner.latency_model import LatencyModel, LengthDistribution
from pdserve.planner.observation import Observation
from pdserve.planner.profile import EngineProfile

logger = logging.getLogger(__name__)


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """What the planner wants for one model now, and why.

    Predictions are at the decided sizes and knobs; None stands for "unbounded" (the load
    exceeds what the pool can carry even at its maximum).
    """

    model: str
    time: float  # the observation's time
    prefill_replicas: int
    decode_replicas: int
    knobs: Knobs
    reasons: list[str]  # one human-readable line per change
    rate: float  # forecast requests/s
    peak_rate: float  # forecast requests/s the pools are sized for
    predicted_ttft_p90_s: float | None
    predicted_itl_p90_s: float | None

    def encode(self) -> bytes:
        """JSON, as published under ``registry.planner_key(model)``."""
        return msgspec.json.encode(self)


@dataclass
class _Pool:
    """One pool's desired size and the intervals of its last changes."""

    name: Role
    metric: str  # "TTFT" | "ITL"
    replicas: int
    minimum: int
    maximum: int
    target_s: float
    down_cooldown: int  # intervals after a change before a shrink; doubles when shrinks flap
    last_up: float = -math.inf
    last_down: float = -math.inf
    last_change: float = -math.inf
    shrink_undid_up: bool = False  # the last shrink came within the flap window of a scale-up
    ready_seen: int = 0  # ready replicas at the last observation
    ready_rose: float = -math.inf  # the interval in which the ready count last rose


class Planner:
    """Sizes one model's prefill and decode pools and tunes its knobs to hold its SLO.

    ``prefill_replicas``, ``decode_replicas`` and ``knobs`` are what is deployed now (read
    from the connector at start); ``knobs`` are also the defaults the planner returns to.
    ``knobs_now`` are the knobs in force when they differ from those defaults (left by an
    earlier planner). ``knob_limits`` caps what the planner raises above the defaults (the
    prefill chunk size) at the workers' start-up budgets, which their engines reserved memory
    for; None leaves it uncapped (the simulator's clusters have no such limit).
    """

    def __init__(
        self,
        slo: SLOTargets,
        profile: EngineProfile,
        config: PlannerConfig = PlannerConfig(),
        *,
        prefill_replicas: int,
        decode_replicas: int,
        knobs: Knobs = Knobs(),
        knobs_now: Knobs | None = None,
        knob_limits: Knobs | None = None,
    ) -> None:
        self.slo = slo
        self.config = config
        self.default_knobs = knobs
        self.knobs = knobs if knobs_now is None else knobs_now
        self.knob_limits = knob_limits
        self.model = LatencyModel(profile)
        self._forecaster = Forecaster(config.forecast)
        self._prefill = _Pool(
            Role.PREFILL,
            "TTFT",
            prefill_replicas,
            slo.min_prefill_replicas,
            slo.max_prefill_replicas,
            slo.ttft_p90_s,
            config.down_cooldown_intervals,
        )
        self._decode = _Pool(
            Role.DECODE,
            "ITL",
            decode_replicas,
            slo.min_decode_replicas,
            slo.max_decode_replicas,
            slo.itl_p90_s,
            config.down_cooldown_intervals,
        )
        self._interval = 0
        self._last_knob_change = -math.inf
        self._recent_peaks: deque[float] = deque(maxlen=config.max_down_cooldown_intervals + 1)
        self._blind_since: float | None = None  # when the traffic stopped being observed
        self._pending: list[str] = []  # changes made outside observe, reported by the next decision

    def set_slo(self, slo: SLOTargets) -> None:
        """Adopt new targets and bounds (``pdserve slo set`` while running); a pool outside its
        new bounds is moved inside them at the next ``observe``."""
        if slo == self.slo:
            return
        self.slo = slo
        for pool, target, low, high in (
            (self._prefill, slo.ttft_p90_s, slo.min_prefill_replicas, slo.max_prefill_replicas),
            (self._decode, slo.itl_p90_s, slo.min_decode_replicas, slo.max_decode_replicas),
        ):
            pool.target_s, pool.minimum, pool.maximum = target, low, high
            bounded = min(max(pool.replicas, low), high)
            if bounded != pool.replicas:
                self._pending.append(f"{pool.name} {pool.replicas} -> {bounded}: new bounds {low}..{high}")
                pool.replicas = bounded
                pool.last_change = self._interval
        logger.info("%s: new SLO %s", slo.model, slo)

    @property
    def prefill_replicas(self) -> int:
        return self._prefill.replicas

    @property
    def decode_replicas(self) -> int:
        return self._decode.replicas

    def observe(self, obs: Observation) -> Decision | None:
        """Fold in one interval's observation; a Decision when pools or knobs should change."""
        self._interval += 1
        if not obs.traffic_observed:
            # No frontend reported: zero arrivals here mean "unknown", and a forecast fed
            # zeros would shrink the pools towards their minimums. Everything holds.
            if self._blind_since is None:
                self._blind_since = obs.time
                logger.warning("%s: no traffic metrics; holding pools and knobs until they return", self.slo.model)
            return None
        if self._blind_since is not None:
            logger.warning("%s: traffic metrics back after %.0f s", self.slo.model, obs.time - self._blind_since)
            self._blind_since = None
        forecast = self._forecaster.update(obs)
        for pool, ready in ((self._prefill, obs.num_prefill_ready), (self._decode, obs.num_decode_ready)):
            if ready > pool.ready_seen:
                pool.ready_rose = self._interval
            pool.ready_seen = ready
        if self._interval <= self.config.warmup_intervals:
            return None
        e2e_target = self.slo.e2e_p90_s
        if e2e_target is not None and obs.e2e_s is not None and obs.e2e_s.p90 > e2e_target:
            logger.warning("%s: end-to-end p90 %s > target %s", self.slo.model, _ms(obs.e2e_s.p90), _ms(e2e_target))
        reasons, self._pending = self._pending, []
        knobs = self._plan_knobs(forecast, reasons)

        model, prompt, output = self.model, forecast.prompt_tokens, forecast.output_tokens
        # Prompts already queued for prefill are work on top of the arrivals, sized to drain
        # within drain_s, and they will need decoding after. (A queue at the decode workers is
        # not: it is pinned to the workers that hold it, and new replicas cannot take it.)
        prefill_backlog = self._backlog_rate(
            self._prefill, obs.num_prefill_ready, obs.prefill_waiting, forecast, model.prefill_capacity(prompt, knobs)
        )
        decode_backlog = obs.prefill_waiting / self.config.drain_s
        # Shrinking is judged at the highest peak of the pool's cool-down window, plus
        # headroom: a pool sized down in a lull, or right at the edge, is sized up again at
        # the next noisy interval.
        self._recent_peaks.append(forecast.peak_rate)

        def high(pool: _Pool) -> float:
            window = list(self._recent_peaks)[-(pool.down_cooldown + 1) :]
            return max(window) * (1 + self.config.shrink_headroom)

        load = f"at {forecast.peak_rate:.1f} req/s peak, {forecast.rate:.1f} mean"

        def ttft(n: int, rate: float = forecast.peak_rate) -> float:
            return model.ttft_p90(n, rate + prefill_backlog, prompt, knobs)

        def itl(n: int, rate: float = forecast.peak_rate) -> float:
            return model.itl_p90(n, rate + decode_backlog, prompt, output, knobs)

        observed_ttft = obs.ttft_s.p90 if obs.ttft_s is not None else None
        observed_itl = obs.itl_s.p90 if obs.itl_s is not None else None
        prefill_load = load + (f" + {prefill_backlog:.1f} req/s of backlog" if prefill_backlog else "")
        decode_load = load + (f" + {decode_backlog:.1f} req/s of backlog" if decode_backlog else "")
        prefill_high, decode_high = high(self._prefill), high(self._decode)
        changed = self._plan_pool(
            self._prefill,
            ttft,
            lambda n: ttft(n, prefill_high),
            observed_ttft,
            obs.num_prefill_ready,
            prefill_load,
            reasons,
        )
        changed |= self._plan_pool(
            self._decode, itl, lambda n: itl(n, decode_high), observed_itl, obs.num_decode_ready, decode_load, reasons
        )
        if knobs != self.knobs:
            self.knobs = knobs
            self._last_knob_change = self._interval
            changed = True
        if not changed and not reasons:
            return None
        decision = Decision(
            model=self.slo.model,
            time=obs.time,
            prefill_replicas=self._prefill.replicas,
            decode_replicas=self._decode.replicas,
            knobs=self.knobs,
            reasons=reasons,
            rate=forecast.rate,
            peak_rate=forecast.peak_rate,
            predicted_ttft_p90_s=_finite(ttft(self._prefill.replicas)),
            predicted_itl_p90_s=_finite(itl(self._decode.replicas)),
        )
        logger.info("%s: %s", self.slo.model, "; ".join(reasons))
        return decision

    def _plan_pool(
        self,
        pool: _Pool,
        predict: Callable[[int], float],
        predict_high: Callable[[int], float],
        observed: float | None,
        ready: int,
        load: str,
        reasons: list[str],
    ) -> bool:
        """Decide ``pool``'s size; appends the reason and returns True when it changes.

        ``predict(n)`` is the p90 at ``n`` replicas under the forecast; ``predict_high(n)``
        under the highest forecast of the cool-down window, which is what a shrink must hold.
        """
        cfg = self.config
        now, target, current = self._interval, pool.target_s, pool.replicas
        wanted, why = current, ""
        predicted = predict(current)
        # Margins apply to what replicas can change: the p90 above the best the pool's
        # maximum reaches (the service time itself, when prompts are long, may be most of it).
        size_bar = _bar(predict(pool.maximum), cfg.size_to, target)
        if not pool.minimum <= current <= pool.maximum:
            wanted, why = current, f"outside the bounds [{pool.minimum}, {pool.maximum}]"
        elif predicted > target * cfg.scale_up_above and current < pool.maximum:
            wanted = next(
                (n for n in range(current + 1, pool.maximum) if self._enough(predict, n, size_bar, target)),
                pool.maximum,
            )
            why = f"predicted {pool.metric} p90 {_ms(predicted)} > target {_ms(target)} {load}"
        elif (
            observed is not None
            and observed > target
            and current < pool.maximum
            and ready >= current
            and now - pool.last_up > cfg.up_cooldown_intervals
            and now - pool.ready_rose >= cfg.cold_start_intervals
        ):
            wanted = current + 1
            why = f"{pool.metric} p90 {_ms(observed)} > target {_ms(target)} {load}"
        elif current > pool.minimum and now - pool.last_change > pool.down_cooldown:
            down_bar = _bar(predict_high(pool.maximum), cfg.scale_down_below, target)
            observed_bar = _bar(predict(pool.maximum), cfg.scale_down_below, target)
            floor = max(pool.minimum, current - self._max_step_down(current))
            smaller = [n for n in range(floor, current) if predict_high(n) <= down_bar]
            if smaller and (observed is None or observed <= observed_bar):
                wanted = smaller[0]
                why = (
                    f"{pool.metric} has slack: predicted p90 {_ms(predict_high(wanted))} at {wanted} replicas "
                    f"(<= {_ms(down_bar)}) and observed {_ms(observed)} (<= {_ms(observed_bar)}), "
                    f"target {_ms(target)} {load}"
                )
        wanted = max(min(wanted, current + cfg.max_step_up), current - self._max_step_down(current))
        if wanted > current:  # replicas not ready are no capacity, and no reason to pile up more
            wanted = max(current, min(wanted, ready + cfg.max_pending))
        wanted = min(max(wanted, pool.minimum), pool.maximum)  # the bounds win over the step limits
        if wanted == current:
            return False
        window = cfg.flap_window_intervals
        if wanted > current:
            # Flapping is up, down, up again, each within the window: the first scale-up after
            # a shrink that had itself undone a scale-up. One step of the load up and back down
            # is not, nor is each further scale-up of one climb.
            if pool.last_down > pool.last_up and now - pool.last_down <= window and pool.shrink_undid_up:
                pool.down_cooldown = min(2 * pool.down_cooldown, cfg.max_down_cooldown_intervals)
                why += f" (a shrink undone within {now - pool.last_down:.0f} intervals: down cool-down now {pool.down_cooldown})"
            pool.last_up = now
        else:
            pool.shrink_undid_up = now - pool.last_up <= window
            if not pool.shrink_undid_up:
                pool.down_cooldown = cfg.down_cooldown_intervals
            pool.last_down = now
        reasons.append(f"{why}: {pool.name} {current}→{wanted}")
        pool.replicas, pool.last_change = wanted, now
        return True

    @staticmethod
    def _enough(predict: Callable[[int], float], n: int, size_bar: float, target: float) -> bool:
        """Whether ``n`` replicas are enough: within the sizing bar, or within the target where
        one more replica would buy less than 1% of it (near the service time's floor, the
        bar can take many replicas for almost nothing)."""
        p = predict(n)
        return p <= size_bar or (p <= target and p - predict(n + 1) < 0.01 * target)

    def _backlog_rate(self, pool: _Pool, ready: int, waiting: float, forecast: Forecast, capacity: float) -> float:
        """Extra requests/s that drain ``waiting`` (and what will queue until new replicas are
        ready) within ``drain_s``; none while replicas are starting: they were ordered for it."""
        if ready < pool.replicas:
            return 0.0
        excess = max(0.0, forecast.peak_rate - ready * capacity)
        return (waiting + excess * self.config.startup_s) / self.config.drain_s

    def _max_step_down(self, replicas: int) -> int:
        return max(1, math.floor(replicas * self.config.max_shrink))

    def _tightens(self, wanted: Knobs) -> bool:
        """Whether ``wanted`` moves any knob further from its default than it is now."""
        return any(
            abs(getattr(wanted, name) - getattr(self.default_knobs, name))
            > abs(getattr(self.knobs, name) - getattr(self.default_knobs, name))
            for name in Knobs.__struct_fields__
        )

    def _plan_knobs(self, forecast: Forecast, reasons: list[str]) -> Knobs:
        """The knobs for the next interval; the TTFT/ITL trades are judged at the maximums."""
        cfg, slo, model = self.config, self.slo, self.model
        rate, prompt, output = forecast.peak_rate, forecast.prompt_tokens, forecast.output_tokens
        max_p, max_d = self._prefill.maximum, self._decode.maximum

        def ttft(knobs: Knobs) -> float:
            return model.ttft_p90(max_p, rate, prompt, knobs)

        def itl(knobs: Knobs) -> float:
            return model.itl_p90(max_d, rate, prompt, output, knobs)

        ttft_ok, itl_ok = slo.ttft_p90_s * cfg.size_to, slo.itl_p90_s * cfg.size_to
        wanted, why = self.default_knobs, []
        context = prompt.mean + output.mean / 2
        cap = min(wanted.decode_max_num_seqs, model.largest_batch_within(itl_ok, context))
        if cap > self.knobs.decode_max_num_seqs:
            # Loosen only as far as a longer context would still allow: the forecast context
            # moves with every interval, and the cap should not follow it up and down.
            loose = model.largest_batch_within(itl_ok, context * (1 + cfg.shrink_headroom))
            cap = min(cap, max(loose, self.knobs.decode_max_num_seqs))
        if cap < wanted.decode_max_num_seqs:
            wanted = replace(wanted, decode_max_num_seqs=cap)
            why.append(f"a decode step of more than {cap} sequences of {context:.0f} tokens exceeds {_ms(itl_ok)}")
        if ttft(wanted) > slo.ttft_p90_s * cfg.scale_up_above:
            why.append(f"TTFT p90 {_ms(ttft(wanted))} > target at the prefill maximum {max_p}")
            if prompt.p90 > wanted.prefill_chunk_size:
                chunk = 1 << math.ceil(math.log2(prompt.p90))
                if self.knob_limits is not None:
                    chunk = min(chunk, self.knob_limits.prefill_chunk_size)
                wanted = replace(wanted, prefill_chunk_size=max(chunk, wanted.prefill_chunk_size))
            # Only prompts whose whole prefill fits in one ITL target go local: a decode step
            # that carries one then at most doubles, and the prompt's TTFT stays tiny.
            short = [
                q
                for q in LengthDistribution.of(prompt).quantiles(0, 0.5)
                if model.profile.prefill_seconds(q) <= slo.itl_p90_s
            ]
            candidates = [replace(wanted, local_prefill_threshold_tokens=_round_up(q)) for q in short]
            candidates = [k for k in candidates if itl(k) <= itl_ok]
            feasible = [k for k in candidates if ttft(k) <= ttft_ok]
            wanted = feasible[0] if feasible else candidates[-1] if candidates else wanted
        if wanted.local_prefill_threshold_tokens and itl(wanted) > slo.itl_p90_s * cfg.scale_up_above:
            why.append(f"ITL p90 {_ms(itl(wanted))} > target at the decode maximum {max_d}")
            wanted = replace(wanted, local_prefill_threshold_tokens=0)
        if wanted.local_prefill_threshold_tokens and itl(wanted) > itl_ok:
            budgets = range(wanted.decode_max_num_batched_tokens, wanted.decode_max_num_seqs - 1, -64)
            smaller = [replace(wanted, decode_max_num_batched_tokens=b) for b in budgets]
            wanted = next((k for k in smaller if itl(k) <= itl_ok), wanted)
        if wanted == self.knobs:
            return self.knobs
        if not self._tightens(wanted) and self._interval - self._last_knob_change <= cfg.down_cooldown_intervals:
            return self.knobs
        changes = ", ".join(
            f"{name} {getattr(self.knobs, name)}→{getattr(wanted, name)}"
            for name in Knobs.__struct_fields__
            if getattr(self.knobs, name) != getattr(wanted, name)
        )
        reasons.append(f"{'; '.join(why) or 'knobs no longer needed'}: {changes}")
        return wanted


def _bar(best: float, fraction: float, target: float) -> float:
    """``fraction`` of the way from ``best`` (the p90 at the pool's maximum) to ``target``;
    nothing passes when even the maximum misses the target."""
    return best + fraction * (target - best) if best < target else -math.inf


def _round_up(tokens: float, multiple: int = 16) -> int:
    return max(multiple, math.ceil(tokens / multiple) * multiple)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    if not math.isfinite(seconds):
        return "unbounded"
    return f"{seconds * 1000:.0f}ms"
