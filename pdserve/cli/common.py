"""Argument types and option groups shared by the ``pdserve`` commands."""

from __future__ import annotations

import argparse

from pdserve.engine.engine_config import KERNEL_CHOICES, EngineConfig


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


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="compute dtype (default: the checkpoint's)",
    )
    group.add_argument(
        "--kernels",
        choices=list(KERNEL_CHOICES),
        default="auto",
        help="compute kernels: triton (GPU); cpu (oneDNN linears and a C decode attention, compiled on first "
        "use with the machine's C compiler and cached in ~/.cache/pdserve or $PDSERVE_CACHE_DIR); torch (the "
        "plain reference); auto = triton on CUDA, else cpu, falling back to torch with a warning when no "
        "compiler builds the C kernel",
    )
    group.add_argument(
        "--kv-cache-memory",
        type=size_bytes,
        default=None,
        help="KV cache budget, e.g. 2G (default: sized automatically)",
    )
    group.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once (default: 64)")
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="per-step token budget; also the prefill chunk size (default: 2048)",
    )
    group.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    group.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        dtype=args.dtype, kernels=args.kernels, kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
    )  # fmt: skip


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine options of ``args`` as command-line arguments (for child workers)."""
    argv = ["--kernels", args.kernels, "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens)]  # fmt: skip
    if args.dtype:
        argv += ["--dtype", args.dtype]
    if args.kv_cache_memory is not None:
        argv += ["--kv-cache-memory", str(args.kv_cache_memory)]
    if args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.no_prefix_caching:
        argv.append("--no-prefix-caching")
    return argv
