"""The ``pdserve`` command line: one module per command group.

- ``common``: argument types and the option groups the commands share (``add_field_option``);
- ``generate``: ``pdserve generate``, one completion, locally or from a server;
- ``up``: ``pdserve up``, a whole deployment on this machine;
- ``serve``: ``pdserve prefill|decode|frontend``, one server process;
- ``frontend_args``: the ``pdserve frontend`` options (shared with ``pdserve up``) and the ``FrontendConfig`` they build;
- ``secrets``: each secret option's ``-file`` form and environment variable, which keep it out of ``ps``;
- ``group_args``: a worker rank's place in a group across hosts (options, or a LeaderWorkerSet's variables);
- ``slo``, ``knobs``: ``pdserve slo|knobs set|show|...``, a model's targets and live settings in etcd;
- ``status``: ``pdserve status``, one screen per model;
- ``top``: ``pdserve top``, a live view of a deployment in the terminal;
- ``top_view``: its frame: the ``Snapshot`` dataclasses and ``render``, a pure function to lines;
- ``top_sources``: its data: etcd and every worker's and frontend's /metrics, each under a deadline;
- ``operate``: ``pdserve workers|drain``, and what the commands that talk to etcd share;
- ``local_deployment``: their defaults from the ``pdserve up`` running on this machine;
- ``planner``: ``pdserve planner``, the control plane's resizing loop;
- ``kube_operator``: ``pdserve operator``, the Kubernetes operator, and ``pdserve remove-deployments``;
- ``profile``: ``pdserve profile``, the engine's speed into a planner profile;
- ``fetch_model``: ``pdserve fetch-model``, the default model into the cache.

``main`` imports only the module of the command it runs: a command that talks to a server
loads none of the others, and no torch (tests/test_import_budget.py holds every such command
to that).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from pdserve import environment
from pdserve.extras import MissingExtra
from pdserve.lifecycle import die_with_parent
from pdserve.observability import logs

# The module that adds each command, in the order ``pdserve --help`` lists them.
COMMANDS = {
    "generate": "generate",
    "up": "up",
    "prefill": "serve",
    "decode": "serve",
    "frontend": "serve",
    "slo": "slo",
    "knobs": "knobs",
    "status": "status",
    "top": "top",
    "workers": "operate",
    "drain": "operate",
    "planner": "planner",
    "operator": "kube_operator",
    "remove-deployments": "kube_operator",
    "profile": "profile",
    "fetch-model": "fetch_model",
}

EPILOG = """examples:
  pdserve up                                              # serve the default model, SmolLM2-135M-Instruct
  pdserve generate --target 127.0.0.1:50051 --prompt "Hello"
  pdserve generate --model ./Llama-3.1-8B --prompt "The capital of France is"
  pdserve up --model ./Llama-3.1-8B                      # frontend + 1 prefill + 1 decode worker
  pdserve generate --target 127.0.0.1:50051 --token-ids 1,2,3 --max-tokens 8 --temperature 0 --json
"""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or only of ``command`` (which imports only its module)."""
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="pdserve: disaggregated prefill/decode LLM serving.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # `pdserve @FILE` reads arguments from FILE, one a line: how the operator's pods get theirs.
        fromfile_prefix_chars="@",
    )
    _add_log_args(parser, environment.log_setting("log_level") or "WARNING", environment.log_setting("log_format"))
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [COMMANDS[command]] if command is not None else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        importlib.import_module(f"pdserve.cli.{name}").add_parser(commands)
    for subparser in commands.choices.values():  # after the command too: `pdserve up --log-format json`
        _add_log_args(subparser, argparse.SUPPRESS, argparse.SUPPRESS)
    return parser


def _add_log_args(parser: argparse.ArgumentParser, level: str, log_format: str | None) -> None:
    parser.add_argument(
        "--log-level",
        default=level,
        metavar="LEVEL",
        help="debug, info, warning, error or critical (default: $PDSERVE_LOG_LEVEL, else warning); "
        "`pdserve up` passes it to every process it starts",
    )
    parser.add_argument(
        "--log-format",
        default=log_format or "text",
        choices=logs.LOG_FORMATS,
        help="text, or json: one JSON object a line with time, level, logger, message and, where known, "
        "request_id and worker_id (default: $PDSERVE_LOG_FORMAT, else text); `pdserve up` passes it on",
    )


def command_in(argv: list[str]) -> str | None:
    """The command ``argv`` names, or None when it names none (help, an error, an @FILE)."""
    for arg in argv:
        if arg.startswith("@"):
            return None
        if arg in COMMANDS:
            return arg
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(command_in(argv))
    args = parser.parse_args(argv)
    die_with_parent()
    try:
        logs.configure(args.log_level, args.log_format)
        os.environ.update(environment.log_env(args.log_level, args.log_format))  # for the children it starts
        return args.func(args)
    except (ValueError, FileNotFoundError, MissingExtra) as error:  # a CheckpointError is a ValueError
        print(f"pdserve {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
