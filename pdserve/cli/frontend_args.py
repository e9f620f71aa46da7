"""The ``pdserve frontend`` options and the ``FrontendConfig`` they build: listening, API keys,
public TLS, routing. ``pdserve up`` takes the same options for its frontend."""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve import environment
from pdserve.cli.common import (
    absolute,
    add_field_option,
    count_or_off,
    cluster_tls,
    duration,
    etcd_auth,
    from_options,
    port_or_off,
    size_bytes,
)
from pdserve.frontend.char_budget import TOKENIZE_WAIT_S
from pdserve.frontend.config import DISAGGREGATION_MODES, FrontendConfig, RouterConfig
from pdserve.rpc.tls import ServerTLS


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    """The ``FrontendConfig`` and ``RouterConfig`` options; build them with ``frontend_config``."""
    add_field_option(parser, "--host", FrontendConfig, "host", help="listen address (default: {default})")
    add_field_option(parser, "--port", FrontendConfig, "port", type=int, help="public gRPC port (default: {default})")
    add_field_option(
        parser,
        "--http-port",
        FrontendConfig,
        "http_port",
        type=port_or_off,
        help="OpenAI-compatible HTTP API port (default: {default}; 0 picks a free one; -1: off)",
    )
    keys = parser.add_argument_group(
        "API keys (the HTTP header 'Authorization: Bearer KEY', or the gRPC metadata "
        "'authorization: Bearer KEY'; the scheme 'Bearer' in any case; health checks and every "
        "process's Prometheus /metrics port stay open)"
    )
    keys.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a key clients must present on both public APIs (repeatable; also $PDSERVE_API_KEYS, "
        "comma-separated); without any key the APIs are open. Visible to every user of the machine in `ps`: "
        "prefer --api-key-file or $PDSERVE_API_KEYS",
    )
    keys.add_argument(
        "--api-key-file", metavar="FILE", help="more keys, one a line (blank lines and #comments skipped)"
    )
    add_field_option(
        keys,
        "--cache-salt-from-key",
        FrontendConfig,
        "cache_salt_from_key",
        action="store_true",
        help="isolate each API key's prefix cache: its requests run under a salt derived from the key (a keyed "
        "hash, never the key), so no key's requests share cached blocks with, or can time, another's. A request's "
        "own cache_salt is appended to its key's salt, never used instead of it, so no tenant can pick another's "
        "salt (default: off; requests share blocks unless they send different cache_salt values)",
    )
    add_field_option(
        keys,
        "--rate-limit",
        FrontendConfig,
        "rate_limit_rps",
        type=float,
        metavar="RPS",
        help="requests a second each API key may start, on either API (without keys: all clients "
        "together); past it HTTP 429 / RESOURCE_EXHAUSTED (default: no limit)",
    )
    add_field_option(
        keys,
        "--rate-limit-burst",
        FrontendConfig,
        "rate_limit_burst",
        type=int,
        help="requests a key may start at once (default: the rate, rounded up)",
    )
    add_field_option(
        parser,
        "--max-request-bytes",
        FrontendConfig,
        "max_request_bytes",
        type=size_bytes,
        help="largest HTTP request body, e.g. 16M; larger ones get 413 (default: {default})",
    )
    add_field_option(
        parser,
        "--max-prompt-chars",
        FrontendConfig,
        "max_prompt_chars",
        type=int,
        help="longest text prompt, refused before tokenizing (default: {default}); a prompt longer than "
        "(max_model_len - 1) times the vocabulary's longest token is refused before tokenizing too",
    )
    add_field_option(
        parser,
        "--max-tokenizing-chars",
        FrontendConfig,
        "max_tokenizing_chars",
        type=int,
        help="prompt characters tokenized at once, all requests together: bounds the frontend's memory "
        f"(~190 bytes a character); a prompt waits up to {TOKENIZE_WAIT_S:g}s for room, then 429 / "
        "RESOURCE_EXHAUSTED (default: {default})",
    )
    add_field_option(
        parser,
        "--header-timeout",
        FrontendConfig,
        "header_timeout_s",
        type=duration,
        help="HTTP API: a request's headers must arrive within this long, or the connection is closed; "
        "protects against clients that hold connections open by sending headers slowly (slowloris) "
        "(default: {default:g}s)",
    )
    add_field_option(
        parser,
        "--max-connections-per-client",
        FrontendConfig,
        "max_connections_per_client",
        type=count_or_off,
        metavar="N",
        help="HTTP API: connections one client address may hold open; more get 429 and are closed at once; "
        "protects against one client exhausting the server's connections (behind a proxy all clients share "
        "its address: raise it, or 0 for no cap) (default: {default})",
    )
    tls = parser.add_argument_group("public API TLS (README: Security)")
    tls.add_argument("--tls-cert", metavar="FILE", help="serve the public API over TLS with this certificate (PEM)")
    tls.add_argument("--tls-key", metavar="FILE", help="the --tls-cert certificate's key (PEM)")
    tls.add_argument(
        "--tls-client-ca", metavar="FILE", help="require client certificates signed by this CA (mTLS); needs --tls-cert"
    )
    add_field_option(
        parser,
        "--disaggregation",
        RouterConfig,
        "disaggregation",
        choices=DISAGGREGATION_MODES,
        help="always: every prompt on a prefill worker; off: on its decode worker (colocated); "
        "conditional: short uncached prompts, or any while the prefill pool is saturated, on the decode worker "
        "(default: {default})",
    )
    threshold = add_field_option(
        parser,
        "--local-prefill-threshold",
        RouterConfig,
        "local_prefill_threshold_tokens",
        type=int,
        metavar="TOKENS",
        help="conditional: prompts with at most this many uncached tokens prefill on the decode "
        "worker; the live knob of the same name (`pdserve knobs set`) replaces it (default: {default})",
    )
    # The option's name until the router's and the knob's settings became one; still accepted.
    parser.add_argument(
        "--local-prefill-tokens", dest=threshold.dest, type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    add_field_option(
        parser,
        "--prefill-saturation-tokens",
        RouterConfig,
        "prefill_saturation_tokens",
        type=int,
        help="conditional: queued prompt tokens at which a prefill worker counts as saturated (default: {default})",
    )
    add_field_option(
        parser,
        "--max-queued-requests",
        FrontendConfig,
        "max_queued_requests",
        type=int,
        help="requests in flight past which new ones get RESOURCE_EXHAUSTED (HTTP 429) (default: {default})",
    )
    add_field_option(
        parser,
        "--request-timeout",
        FrontendConfig,
        "request_timeout_s",
        type=duration,
        help="deadline of a request whose caller set none (default: {default:g}s)",
    )
    add_field_option(
        parser,
        "--max-migrations",
        FrontendConfig,
        "max_migrations",
        type=int,
        help="times a request whose decode worker failed mid-stream goes on on another decode worker, keeping the "
        "tokens already streamed (default: {default}; 0: never)",
    )
    add_field_option(
        parser,
        "--migration-wait",
        FrontendConfig,
        "migration_wait_s",
        type=duration,
        help="how long such a request waits for a decode worker to go to when none is left (one restarting) "
        "before it fails UNAVAILABLE (default: {default:g}s; 0: fail at once)",
    )
    add_field_option(
        parser,
        "--tokenizer",
        FrontendConfig,
        "tokenizer",
        help="tokenizer directory (default: the workers' model directory)",
    )
    add_field_option(
        parser,
        "--metrics-port",
        FrontendConfig,
        "metrics_port",
        type=port_or_off,
        help="Prometheus /metrics port, open to anyone who reaches it: no API key or TLS (default: {default}; "
        "0 picks a free one; -1: off)",
    )
    add_field_option(
        parser,
        "--stats-window",
        FrontendConfig,
        "stats_window_s",
        type=duration,
        help="span of the live latency percentiles published in etcd for `pdserve status` and the planner "
        "(default: {default:g}s; match the planner's interval)",
    )


def frontend_config(args: argparse.Namespace, etcd: str) -> FrontendConfig:
    """The frontend's configuration from the options of ``add_frontend_args``,
    ``add_cluster_tls_args`` and ``add_etcd_auth_args``."""
    return from_options(
        args,
        FrontendConfig,
        etcd=etcd,
        router=from_options(args, RouterConfig),
        api_keys=api_keys(args),
        tls=public_tls(args),
        cluster_tls=cluster_tls(args),
        etcd_auth=etcd_auth(args),
    )


def public_tls(args: argparse.Namespace) -> ServerTLS | None:
    """The public API's TLS from ``--tls-cert``, ``--tls-key`` and ``--tls-client-ca``."""
    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        raise ValueError("public API TLS needs both --tls-cert and --tls-key")
    tls = ServerTLS(
        cert=str(absolute(args.tls_cert)), key=str(absolute(args.tls_key)), client_ca=absolute(args.tls_client_ca)
    )
    tls.check()
    return tls


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys of ``--api-key``, ``--api-key-file`` and ``$PDSERVE_API_KEYS``, in that order,
    each once. ValueError naming the file (never a key) when it cannot be read."""
    keys = list(args.api_key)
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file {args.api_key_file}: {exc}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    keys += environment.api_keys()
    return list(dict.fromkeys(key.strip() for key in keys))
