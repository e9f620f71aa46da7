"""The frontend's configuration: the ``pdserve frontend`` options, or the JSON file
``pdserve up`` hands its frontend with ``--config``."""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from pdserve.discovery.etcd_auth import EtcdAuth
from pdserve.discovery.knobs import LOCAL_PREFILL_THRESHOLD_TOKENS
from pdserve.rpc.tls import ClusterTLS, ServerTLS

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
    host / port: where the public gRPC API listens.
    http_port: where the OpenAI-compatible HTTP API listens (0: a free one; None: off).
    api_keys: keys a client must present on both public APIs (``Authorization: Bearer KEY``);
        none: the APIs are open. Health checks stay open either way.
    cache_salt_from_key: each API key's requests share prefix-cache blocks only among
        themselves: the key's salt (a keyed hash of it) comes first in every salt they run
        under, and a request's own ``cache_salt`` is added after it, never instead of it
        (``frontend.cache_salt``). Needs ``api_keys``.
    max_request_bytes: largest HTTP request body (413 past it).
    max_prompt_chars: longest text prompt, checked before it is tokenized (400 past it).
    max_tokenizing_chars: prompt characters tokenized at once across requests; a prompt waits
        for room, then gets RESOURCE_EXHAUSTED (429). Tokenizing takes ~190 bytes a character
        at its peak, so the default bounds it to ~400 MB.
    header_timeout_s: seconds an HTTP request's headers may take to arrive (from the
        connection's first byte, or the request's); slower connections are closed.
    max_connections_per_client: HTTP connections one client address may hold open (429 and
        closed past it; None: no cap). Behind a proxy every client shares the proxy's address.
    rate_limit_rps: requests a second each API key may start on either API (None: no limit;
        without keys, all clients share it); ``rate_limit_burst`` at once (default: the rate).
    router: routing and disaggregation settings.
    max_queued_requests: requests in flight past which new ones get RESOURCE_EXHAUSTED.
    request_timeout_s: the deadline of a request whose caller set none (or a longer one).
    tokenizer: a tokenizer directory for text prompts (default: the workers' model directory).
    max_migrations: times a request whose decode worker's stream broke may go on on another
        decode worker (with the tokens already streamed), within its deadline; 0: never.
    migration_wait_s: how long such a request waits for a decode worker to go to when none is
        left (the only other one restarting, a new pod coming) before it fails UNAVAILABLE.
    metrics_port: Prometheus /metrics port (0: a free one; None: off).
    stats_window_s: the span of the live percentiles published in etcd for ``pdserve status``
        and the planner; the planner's interval is the natural choice.
    tls: TLS of the public API (``--tls-cert``, ``--tls-key``; ``--tls-client-ca`` requires
        client certificates); None: plaintext.
    cluster_tls: the cluster's certificate set: calls to workers go over mTLS with it.
    etcd_auth: etcd's TLS settings and user.
    """

    etcd: str
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int | None = 8000
    api_keys: list[str] = []
    cache_salt_from_key: bool = False
    max_request_bytes: int = 16 * 2**20
    max_prompt_chars: int = 4 * 2**20
    max_tokenizing_chars: int = 2 * 2**20
    header_timeout_s: float = 10.0
    max_connections_per_client: int | None = 256
    rate_limit_rps: float | None = None
    rate_limit_burst: int | None = None
    router: RouterConfig = RouterConfig()
    max_queued_requests: int = 1024
    request_timeout_s: float = 600.0
    tokenizer: str | None = None
    max_migrations: int = 2
    migration_wait_s: float = 30.0
    metrics_port: int | None = 0
    stats_window_s: float = 10.0
    tls: ServerTLS | None = None
    cluster_tls: ClusterTLS | None = None
    etcd_auth: EtcdAuth = EtcdAuth()

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535] or None (off), got {self.http_port}")
        if any(not key or key != key.strip() for key in self.api_keys):
            raise ValueError("api_keys: a key is empty or has surrounding whitespace")  # never echo a key
        if self.cache_salt_from_key and not self.api_keys:
            raise ValueError("cache_salt_from_key needs api_keys: salts are derived from them")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.rate_limit_rps is not None and not 0 < self.rate_limit_rps < float("inf"):
            raise ValueError(f"rate_limit_rps must be > 0 or None (off), got {self.rate_limit_rps}")
        if self.rate_limit_burst is not None and self.rate_limit_burst < 1:
            raise ValueError(f"rate_limit_burst must be >= 1, got {self.rate_limit_burst}")
        if self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")
        if self.max_tokenizing_chars < 1:
            raise ValueError(f"max_tokenizing_chars must be >= 1, got {self.max_tokenizing_chars}")
        if not 0 < self.header_timeout_s < float("inf"):
            raise ValueError(f"header_timeout_s must be > 0, got {self.header_timeout_s}")
        if self.max_connections_per_client is not None and self.max_connections_per_client < 1:
            raise ValueError(
                f"max_connections_per_client must be >= 1 or None (no cap), got {self.max_connections_per_client}"
            )
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.migration_wait_s < 0:
            raise ValueError(f"migration_wait_s must be >= 0, got {self.migration_wait_s}")
        if not self.stats_window_s > 0:
            raise ValueError(f"stats_window_s must be > 0, got {self.stats_window_s}")
