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
from typing import Any, TypeVar

import msgspec

from pdserve.engine.engine_config import DTYPE_CHOICES, KERNEL_CHOICES, KV_CACHE_DTYPE_CHOICES, EngineConfig

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


def seconds(text: str) -> float:
    """A duration: ``500ms``, ``2s``, ``1.5`` (seconds)."""
    value = text.strip().lower()
    try:
        if value.endswith("ms"):
            return float(value[:-2]) / 1e3
        return float(value.removesuffix("s"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a duration such as 500ms or 2s, got {text!r}") from None


def port_or_off(text: str) -> int | None:
    """A port number; a negative one turns the server off (None)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, or -1 for off, got {text!r}") from None
    return None if port < 0 else port


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
    return parser.add_argument(flag, dest=f"{struct.__name__}.{field}", default=argparse.SUPPRESS,
                               help=help.format(default=default), **kwargs)  # fmt: skip


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
    add_field_option(group, "--dtype", EngineConfig, "dtype", choices=DTYPE_CHOICES,
                     help="compute dtype (default: the checkpoint's)")  # fmt: skip
    add_field_option(
        group, "--kernels", EngineConfig, "kernels", choices=KERNEL_CHOICES,
        help="compute kernels: triton (GPU); cpu (oneDNN linears and a C decode attention, compiled on first "
        "use with the machine's C compiler and cached in ~/.cache/pdserve or $PDSERVE_CACHE_DIR); torch (the "
        "plain reference); auto = triton on CUDA, else cpu, falling back to torch with a warning when no "
        "compiler builds the C kernel (default: {default})",
    )  # fmt: skip
    add_field_option(group, "--kv-cache-memory", EngineConfig, "kv_cache_memory", type=size_bytes,
                     help="KV cache budget, e.g. 2G (default: sized automatically)")  # fmt: skip
    add_field_option(
        group, "--kv-cache-dtype", EngineConfig, "kv_cache_dtype", choices=KV_CACHE_DTYPE_CHOICES,
        help="KV cache storage: auto = the model dtype; fp8_e4m3 = float8 with per-layer scales (the "
        "checkpoint's k_scale/v_scale, else 1), half the bytes of bfloat16 held and moved per token; cpu and "
        "torch kernels only; prefill and decode workers must agree (default: {default})",
    )  # fmt: skip
    add_field_option(group, "--max-num-seqs", EngineConfig, "max_num_seqs", type=int,
                     help="most requests running at once (default: {default})")  # fmt: skip
    add_field_option(group, "--max-num-batched-tokens", EngineConfig, "max_num_batched_tokens", type=int,
                     help="per-step token budget; also the prefill chunk size (default: {default})")  # fmt: skip
    add_field_option(group, "--max-model-len", EngineConfig, "max_model_len", type=int,
                     help="context window (default: the model's)")  # fmt: skip
    add_field_option(group, "--no-prefix-caching", EngineConfig, "enable_prefix_caching", action="store_false",
                     help="disable the prefix cache")  # fmt: skip
