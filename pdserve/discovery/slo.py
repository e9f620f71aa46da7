"""A model's latency targets and replica bounds: what the planner holds, with the fewest GPUs.

``SLOTargets`` is stored as JSON in etcd under ``registry.slo_key(model)``
(``/pdserve/v1/slo/{model}``); the operator writes it from the custom resource's
``spec.slo`` and the CLI from its flags, both through ``types.duration.parse_duration`` for the targets.
"""

from __future__ import annotations

import math

import msgspec

from pdserve.discovery.registry import Role


class SLOTargets(msgspec.Struct, frozen=True, kw_only=True):
    """Latency targets for one model and the replica bounds the planner must stay within.

    Latencies are 90th percentiles in seconds over a planner interval, across requests: TTFT
    is arrival to first token, ITL a request's mean gap between consecutive tokens, E2E
    arrival to last token (optional: the planner logs a breach but sizes nothing on it).
    A pool never goes below one replica: the router needs a worker of each role, and an
    empty pool has no latency to observe.
    """

    model: str
    ttft_p90_s: float
    itl_p90_s: float
    e2e_p90_s: float | None = None
    min_prefill_replicas: int = 1
    max_prefill_replicas: int = 8
    min_decode_replicas: int = 1
    max_decode_replicas: int = 8

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must not be empty")
        for name in ("ttft_p90_s", "itl_p90_s", "e2e_p90_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for role in Role:
            low, high = getattr(self, f"min_{role}_replicas"), getattr(self, f"max_{role}_replicas")
            if low < 1:
                raise ValueError(f"min_{role}_replicas must be >= 1, got {low}")
            if high < low:
                raise ValueError(f"max_{role}_replicas ({high}) must be >= min_{role}_replicas ({low})")

    def encode(self) -> bytes:
        """The JSON value stored in etcd."""
        return msgspec.json.encode(self)

    @staticmethod
    def decode(data: bytes | str) -> SLOTargets:
        """Parse a stored value; raises ValueError naming what is wrong."""
        try:
            return msgspec.json.decode(data, type=SLOTargets)
        except msgspec.DecodeError as error:  # ValidationError (a failed check) is a DecodeError
            raise ValueError(f"SLO targets do not decode: {error}") from None
