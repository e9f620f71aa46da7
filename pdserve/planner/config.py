"""How the planner decides: its margins, cool-downs and step limits (``PlannerConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.planner.forecast import ForecastConfig


@dataclass(frozen=True)
class PlannerConfig:
    """How the planner decides. Margins are fractions of the distance from the p90 a pool
    reaches at its maximum size to the target (see the module docstring)."""

    interval_s: float = 10.0  # how often the service loop observes and decides
    warmup_intervals: int = 2  # intervals observed before the first decision
    scale_up_above: float = 1.0  # x target: a predicted p90 above this at the current size scales up
    size_to: float = 0.85  # a scale-up (or a knob) aims this far from best towards the target
    scale_down_below: float = 0.7  # a scale-down needs prediction and observation within this
    up_cooldown_intervals: int = 2  # after a scale-up, before one that only an observed breach asks for
    down_cooldown_intervals: int = 6  # after any change of a pool (of the knobs), before it shrinks (loosens)
    max_step_up: int = 8  # replicas added to a pool at once
    max_pending: int = 16  # replicas requested and not yet ready, per pool, at most
    cold_start_intervals: int = 2  # after a pool's ready count rises, its latency alone scales nothing
    flap_window_intervals: int = 30  # up, down, up within this doubles the pool's down cool-down
    max_down_cooldown_intervals: int = 36  # the most that doubling reaches
    max_shrink: float = 0.25  # of a pool removed at once (at least one replica)
    shrink_headroom: float = 0.1  # a smaller pool must hold this much above the window's peak rate
    drain_s: float = 15.0  # a queue of waiting prompts is sized to drain within this
    startup_s: float = 30.0  # how long a new replica takes to be ready (the queue grows meanwhile)
    forecast: ForecastConfig = field(default_factory=ForecastConfig)

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {self.interval_s}")
        if not 0 < self.scale_down_below < self.size_to <= self.scale_up_above:
            raise ValueError(
                "need 0 < scale_down_below < size_to <= scale_up_above, got "
                f"{self.scale_down_below}, {self.size_to}, {self.scale_up_above}"
            )
        if self.drain_s <= 0 or self.startup_s < 0:
            raise ValueError(f"drain_s must be positive and startup_s >= 0, got {self.drain_s}, {self.startup_s}")
        if self.max_step_up < 1 or self.max_pending < 1:
            raise ValueError(f"max_step_up and max_pending must be >= 1, got {self.max_step_up}, {self.max_pending}")
        if not 0 <= self.max_shrink < 1:
            raise ValueError(f"max_shrink must be in [0, 1), got {self.max_shrink}")
        if self.shrink_headroom < 0:
            raise ValueError(f"shrink_headroom must be >= 0, got {self.shrink_headroom}")
        if min(self.warmup_intervals, self.up_cooldown_intervals, self.down_cooldown_intervals) < 0:
            raise ValueError("warmup and cool-down intervals must be >= 0")
        if min(self.cold_start_intervals, self.flap_window_intervals) < 0:
            raise ValueError("cold_start_intervals and flap_window_intervals must be >= 0")
        if self.max_down_cooldown_intervals < self.down_cooldown_intervals:
            raise ValueError(
                f"max_down_cooldown_intervals ({self.max_down_cooldown_intervals}) must be >= "
                f"down_cooldown_intervals ({self.down_cooldown_intervals})"
            )
