"""The ``pdserve`` command line: one module per command group."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve.cli import fetch_model, generate, knobs, kube_operator, operate, planner, profile, serve, slo, status, up
from pdserve.extras import MissingExtra
from pdserve.lifecycle import die_with_parent

EPILOG = """examples:
  pdserve up                                              # serve the default model, SmolLM2-135M-Instruct
  pdserve generate --target 127.0.0.1:50051 --prompt "Hello"
  pdserve generate --model ./Llama-3.1-8B --prompt "The capital of France is"
  pdserve up --model ./Llama-3.1-8B                      # frontend + 1 prefill + 1 decode worker
  pdserve generate --target 127.0.0.1:50051 --token-ids 1,2,3 --max-tokens 8 --temperature 0 --json
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="pdserve: disaggregated prefill/decode LLM serving.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # `pdserve @FILE` reads arguments from FILE, one a line: how the operator's pods get theirs.
        fromfile_prefix_chars="@",
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: WARNING)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.add_parser(commands)
    up.add_parser(commands)
    serve.add_parsers(commands)
    slo.add_parser(commands)
    knobs.add_parser(commands)
    status.add_parser(commands)
    operate.add_parser(commands)
    planner.add_parser(commands)
    kube_operator.add_parser(commands)
    profile.add_parser(commands)
    fetch_model.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    die_with_parent()
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, MissingExtra) as error:  # a CheckpointError is a ValueError
        print(f"pdserve {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
