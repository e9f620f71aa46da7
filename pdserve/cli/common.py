"""Argument types and option groups shared by the ``pdserve`` commands.

A configuration has one home: its struct (``EngineConfig``, ``WorkerConfig``,
``FrontendConfig``, ``RouterConfig``) holds every field's default and check, and it is what
travels to a child process (``pdserve up`` writes each child's as JSON and starts it with
``--config FILE``). The command line only fills it in. An option for a field is added with
``add_field_option``: it stores under ``"Struct.field"`` and has no default of its own, so a
field whose option is not given keeps the struct's default, which the help reads from the
struct (``{default}`` in the help text). ``from_options`` builds the struct from the options
given.

Adding an engine option is therefore a field in ``EngineConfig`` (its default and its check)
plus its ``add_field_option`` line in ``add_engine_args``, and nothing else: every command
with engine options builds its ``EngineConfig`` with ``from_options``, and ``pdserve up``
hands it to each worker inside its ``WorkerConfig``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from pdserve.cli.secrets import add_secret_option, secret
from pdserve.environment import ETCD_AUTH_SETTINGS, etcd_auth_setting
from pdserve.rpc.tls import DEFAULT_CLUSTER_SERVER_NAME, ClientTLS, ClusterTLS
from pdserve.types.duration import parse_duration
from pdserve.types.engine_config import DTYPE_CHOICES, KERNEL_CHOICES, KV_CACHE_DTYPE_CHOICES, EngineConfig

if TYPE_CHECKING:
    from pdserve.discovery.etcd_auth import EtcdAuth

Config = TypeVar("Config", bound=msgspec.Struct)


def token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--token-ids must be comma-separated integers, got {text!r}") from None


def size_bytes(text: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 512M or 4G, got {text!r}") from None


def duration(text: str) -> float:
    """The argparse type of every duration option: ``500ms``, ``2s``, ``1m``, ``1.5`` (seconds),
    as ``types.duration.parse_duration`` reads them."""
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_duration(text: str) -> float:
    """``duration``, for an option that has no struct to check it: more than zero."""
    value = duration(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"duration {text!r} must be positive")
    return value


def port_or_off(text: str) -> int | None:
    """A port number; a negative one turns the server off (None)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, or -1 for off, got {text!r}") from None
    return None if port < 0 else port


def count_or_off(text: str) -> int | None:
    """A count of at least 1; 0 turns the limit off (None)."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, or 0 for no limit, got {text!r}") from None
    if count < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number, or 0 for no limit, got {text!r}")
    return None if count == 0 else count


def field_default(struct: type[msgspec.Struct], name: str) -> Any:
    """The default of ``struct``'s field ``name``."""
    for field in msgspec.structs.fields(struct):
        if field.name == name:
            return field.default
    raise AttributeError(f"{struct.__name__} has no field {name!r}")


def add_field_option(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    struct: type[msgspec.Struct],
    field: str,
    *,
    help: str,
    **kwargs: Any,
) -> argparse.Action:
    """Add ``flag``, which sets ``struct``'s ``field``; ``{default}`` in ``help`` shows the
    field's default (format it as the field's type, e.g. ``{default:g}s``)."""
    default = field_default(struct, field)  # raises for a field the struct does not have
    if kwargs.get("action") is None and "choices" not in kwargs:
        kwargs.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
    return parser.add_argument(
        flag, dest=f"{struct.__name__}.{field}", default=argparse.SUPPRESS, help=help.format(default=default), **kwargs
    )


def from_options(args: argparse.Namespace, struct: type[Config], **fields: Any) -> Config:
    """``struct`` from the options ``add_field_option`` added for it that were given, and ``fields``;
    ValueError, from the struct's checks, naming a bad field."""
    prefix = f"{struct.__name__}."
    given = {name.removeprefix(prefix): value for name, value in vars(args).items() if name.startswith(prefix)}
    return struct(**given, **fields)


def given_fields(args: argparse.Namespace) -> list[str]:
    """The struct fields whose options were given (``add_field_option``), as ``Struct.field``."""
    return [name for name in vars(args) if "." in name]


def read_config(path: str, struct: type[Config]) -> Config:
    """The ``--config`` file: ``struct`` as JSON; ValueError naming the file and the bad field."""
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=struct)
    except OSError as error:
        raise ValueError(f"--config {path}: {error.strerror}") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise ValueError(f"--config {path}: not a {struct.__name__}: {error}") from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The ``EngineConfig`` options; build the config with ``from_options(args, EngineConfig)``."""
    group = parser.add_argument_group("engine")
    add_field_option(
        group, "--dtype", EngineConfig, "dtype", choices=DTYPE_CHOICES, help="compute dtype (default: the checkpoint's)"
    )
    add_field_option(
        group,
        "--kernels",
        EngineConfig,
        "kernels",
        choices=KERNEL_CHOICES,
        help="compute kernels: triton (GPU); cpu (oneDNN linears and a C decode attention, compiled on first "
        "use with the machine's C compiler and cached in ~/.cache/pdserve or $PDSERVE_CACHE_DIR); torch (the "
        "plain reference); auto = triton on CUDA, else cpu, falling back to torch with a warning when no "
        "compiler builds the C kernel (default: {default})",
    )
    add_field_option(
        group,
        "--kv-cache-memory",
        EngineConfig,
        "kv_cache_memory",
        type=size_bytes,
        help="KV cache budget, e.g. 2G (default: sized automatically)",
    )
    add_field_option(
        group,
        "--kv-cache-dtype",
        EngineConfig,
        "kv_cache_dtype",
        choices=KV_CACHE_DTYPE_CHOICES,
        help="KV cache storage: auto = the model dtype; fp8_e4m3 = float8 with per-layer scales (the "
        "checkpoint's k_scale/v_scale, else 1), half the bytes of bfloat16 held and moved per token; cpu and "
        "torch kernels only; prefill and decode workers must agree (default: {default})",
    )
    add_field_option(
        group,
        "--max-num-seqs",
        EngineConfig,
        "max_num_seqs",
        type=int,
        help="most requests running at once (default: {default})",
    )
    add_field_option(
        group,
        "--max-num-batched-tokens",
        EngineConfig,
        "max_num_batched_tokens",
        type=int,
        help="per-step token budget; also the prefill chunk size (default: {default})",
    )
    add_field_option(
        group, "--max-model-len", EngineConfig, "max_model_len", type=int, help="context window (default: the model's)"
    )
    add_field_option(
        group,
        "--no-prefix-caching",
        EngineConfig,
        "enable_prefix_caching",
        action="store_false",
        help="disable the prefix cache",
    )


def add_etcd_auth_args(parser: argparse.ArgumentParser) -> None:
    """etcd's TLS and auth options; build the ``EtcdAuth`` with ``etcd_auth``."""
    group = parser.add_argument_group("etcd TLS and auth (README: Security)")
    group.add_argument(
        "--etcd-cacert",
        metavar="FILE",
        help="CA that etcd's certificate chains to, for an https:// etcd URL "
        "(default: $PDSERVE_ETCD_CACERT, else the system's roots)",
    )
    group.add_argument(
        "--etcd-cert",
        metavar="FILE",
        help="client certificate for an etcd run with --client-cert-auth; with auth enabled and "
        "no --etcd-user its common name is the etcd user (default: $PDSERVE_ETCD_CERT)",
    )
    group.add_argument("--etcd-key", metavar="FILE", help="the client certificate's key (default: $PDSERVE_ETCD_KEY)")
    group.add_argument(
        "--etcd-server-name",
        metavar="NAME",
        help="the name etcd's certificate must carry, if not the URL's host: pdserve-cluster for the "
        "registry of a `pdserve up` given cluster certificates (default: $PDSERVE_ETCD_SERVER_NAME)",
    )
    group.add_argument("--etcd-user", metavar="NAME", help="etcd user, with auth enabled (default: $PDSERVE_ETCD_USER)")
    add_secret_option(
        group, "--etcd-password", env="PDSERVE_ETCD_PASSWORD", metavar="PASSWORD", help="the etcd user's password"
    )


def etcd_auth(args: argparse.Namespace) -> EtcdAuth:
    """The ``EtcdAuth`` the options of ``add_etcd_auth_args`` (else ``$PDSERVE_ETCD_*``) give;
    ValueError naming a missing or bad file."""
    # Here, not at the top: etcd's client takes a tenth of a second to import, and
    # `pdserve generate --target` builds its parser from this module without talking to etcd.
    from pdserve.discovery.etcd_auth import EtcdAuth

    given = {name: getattr(args, name, None) or etcd_auth_setting(name) for name in ETCD_AUTH_SETTINGS}
    given["etcd_password"] = secret(args, "etcd_password", etcd_auth_setting("etcd_password"))
    tls = None
    if given["etcd_cacert"] or given["etcd_cert"] or given["etcd_key"] or given["etcd_server_name"]:
        tls = ClientTLS(
            ca=absolute(given["etcd_cacert"]),
            cert=absolute(given["etcd_cert"]),
            key=absolute(given["etcd_key"]),
            server_name=given["etcd_server_name"],
        )
        tls.check()
    return EtcdAuth(tls=tls, user=given["etcd_user"], password=given["etcd_password"])


def given_etcd_auth_options(args: argparse.Namespace) -> list[str]:
    """The etcd TLS and auth options given on the command line (not from the environment)."""
    return [name for name in (*ETCD_AUTH_SETTINGS, "etcd_password_file") if getattr(args, name, None)]


def absolute(path: str | None) -> str | None:
    """``path`` made absolute, so that it means the same file to a child in another directory."""
    return None if path is None else str(Path(path).absolute())


def add_cluster_tls_args(parser: argparse.ArgumentParser, who: str) -> None:
    """The cluster certificate set's options (``cluster_tls`` builds it); ``who`` says what uses it."""
    group = parser.add_argument_group("cluster mTLS (README: Security)")
    group.add_argument(
        "--cluster-ca", metavar="FILE", help=f"the cluster CA: {who}; with --cluster-cert and --cluster-key"
    )
    group.add_argument(
        "--cluster-cert",
        metavar="FILE",
        help="this component's cluster certificate; it must name the cluster server name "
        f"(--cluster-server-name, default {DEFAULT_CLUSTER_SERVER_NAME}) in its DNS SANs",
    )
    group.add_argument("--cluster-key", metavar="FILE", help="the cluster certificate's key")
    group.add_argument(
        "--cluster-server-name",
        metavar="NAME",
        default=DEFAULT_CLUSTER_SERVER_NAME,
        help="the DNS name internal clients check in every server's certificate, whatever address "
        "they dial (default: %(default)s)",
    )


def cluster_tls(args: argparse.Namespace) -> ClusterTLS | None:
    """The cluster certificate set the options give (all three files, or none); ValueError
    naming a missing or bad file."""
    files = {"--cluster-ca": args.cluster_ca, "--cluster-cert": args.cluster_cert, "--cluster-key": args.cluster_key}
    if not any(files.values()):
        return None
    missing = [flag for flag, value in files.items() if not value]
    if missing:
        raise ValueError(
            f"cluster mTLS needs --cluster-ca, --cluster-cert and --cluster-key; missing {', '.join(missing)}"
        )
    tls = ClusterTLS(
        ca=str(absolute(args.cluster_ca)),
        cert=str(absolute(args.cluster_cert)),
        key=str(absolute(args.cluster_key)),
        server_name=args.cluster_server_name,
    )
    tls.check()
    return tls
