"""The frontend's configuration: the ``pdserve frontend`` options, or the JSON file
``pdserve up`` hands its frontend with ``--config``."""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from pdserve.discovery.knobs import LOCAL_PREFILL_THRESHOLD_TOKENS

Disaggregation = Literal["always", "conditional", "off"]
DISAGGREGATION_MODES: tuple[Disaggregation, ...] = get_args(Disaggregation)


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Attributes:
    disaggregation: "always" (every prompt on a prefill worker), "conditional", or "off"
        (every prompt on its decode worker: a colocated deployment).
    local_prefill_threshold_tokens: conditional: prompts with at most this many uncached
        tokens are prefilled on the decode worker (the live knob of the same name replaces it).
    prefill_saturation_tokens: conditional: a prefill worker with this many prompt tokens
        queued is saturated; when all are, prompts are prefilled on the decode worker.
    """

    disaggregation: Disaggregation = "conditional"
    local_prefill_threshold_tokens: int = LOCAL_PREFILL_THRESHOLD_TOKENS
    prefill_saturation_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.disaggregation not in DISAGGREGATION_MODES:
            raise ValueError(f"disaggregation must be one of {DISAGGREGATION_MODES}, got {self.disaggregation!r}")
        if self.local_prefill_threshold_tokens < 0:
            raise ValueError(f"local_prefill_threshold_tokens must be >= 0, got {self.local_prefill_threshold_tokens}")
        if self.prefill_saturation_tokens < 1:
            raise ValueError(f"prefill_saturation_tokens must be >= 1, got {self.prefill_saturation_tokens}")


class FrontendConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Attributes:
    etcd: the registry's URL.
    host / port: where the public API listens.
    router: routing and disaggregation settings.
    max_queued_requests: requests in flight past which new ones get RESOURCE_EXHAUSTED.
    request_timeout_s: the deadline of a request whose caller set none (or a longer one).
    tokenizer: a tokenizer directory for text prompts (default: the workers' model directory).
    max_migrations: times a request whose decode worker's stream broke may go on on another
        decode worker (with the tokens already streamed), within its deadline; 0: never.
    metrics_port: Prometheus /metrics port (0: a free one; None: off).
    stats_window_s: the span of the live percentiles published in etcd for ``pdserve status``
        and the planner; the planner's interval is the natural choice.
    """

    etcd: str
    host: str = "127.0.0.1"
    port: int = 50051
    router: RouterConfig = RouterConfig()
    max_queued_requests: int = 1024
    request_timeout_s: float = 600.0
    tokenizer: str | None = None
    max_migrations: int = 2
    metrics_port: int | None = 0
    stats_window_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if not self.stats_window_s > 0:
            raise ValueError(f"stats_window_s must be > 0, got {self.stats_window_s}")
