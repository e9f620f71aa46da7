"""``pdserve slo set|show|delete``: a model's latency targets and replica bounds, in etcd."""

from __future__ import annotations

import argparse

import aetcd
import msgspec

from pdserve.cli.common import field_default, positive_duration
from pdserve.cli.operate import (
    EXIT_STATUS,
    OperationFailed,
    add_etcd_arg,
    fmt_seconds,
    print_json,
    run_with_etcd,
    table,
)
from pdserve.discovery.registry import Role, slo_key
from pdserve.discovery.slo import SLOTargets
from pdserve.discovery.slo_store import delete_slo, get_slo, list_slos, put_slo

DESCRIPTION = """A model's SLO: the 90th-percentile time to first token (TTFT) and inter-token
latency (ITL) the planner sizes the prefill and decode pools to hold, an optional end-to-end
p90, and the replica bounds it must stay within. Stored as JSON in etcd at
/pdserve/v1/slo/MODEL, where the planner and `pdserve status` read it."""

EXAMPLES = f"""examples:
  pdserve slo set --model meta-llama/Llama-3.1-8B --ttft-p90 500ms --itl-p90 30ms
  pdserve slo set --model meta-llama/Llama-3.1-8B --max-decode 16        # change one field, keep the rest
  pdserve slo set --model meta-llama/Llama-3.1-8B --e2e-p90 none         # drop the end-to-end target
  pdserve slo show
  pdserve slo show --model meta-llama/Llama-3.1-8B --json

Durations: 500ms, 0.5s, 250us, 1m, or a bare number of seconds.
{EXIT_STATUS}
"""

SET_HELP = """Create or change a model's targets. Flags not given keep their stored values; a
model with no targets yet needs --ttft-p90 and --itl-p90, and its replica bounds default as
shown below. Prints what was stored (the last writer wins)."""

SHOW_HELP = """Print stored targets as a table, or with --json a JSON list (one object with
--model)."""


def _optional_duration(text: str) -> float | None:
    return None if text.strip().lower() in ("none", "off", "") else positive_duration(text)


def add_parser(commands: argparse._SubParsersAction) -> None:
    slo = commands.add_parser(
        "slo",
        help="set or show a model's latency targets (SLO)",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = slo.add_subparsers(dest="action", required=True, metavar="ACTION")

    set_ = actions.add_parser(
        "set",
        help="create or change a model's targets",
        description=SET_HELP,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_etcd_arg(set_)
    set_.add_argument("--model", required=True, help="served model name, as workers register it")
    set_.add_argument(
        "--ttft-p90", type=positive_duration, metavar="DURATION", help="p90 time to first token, e.g. 500ms"
    )
    set_.add_argument(
        "--itl-p90", type=positive_duration, metavar="DURATION", help="p90 inter-token latency, e.g. 30ms"
    )
    set_.add_argument(
        "--e2e-p90",
        type=_optional_duration,
        default=argparse.SUPPRESS,
        metavar="DURATION",
        help="p90 end-to-end latency, e.g. 20s; `none` removes it (default: keep; none)",
    )
    for role in Role:
        for bound in ("min", "max"):
            set_.add_argument(
                f"--{bound}-{role}",
                type=int,
                metavar="N",
                help=f"{bound}imum {role} replicas (default: keep; "
                f"{field_default(SLOTargets, f'{bound}_{role}_replicas')})",
            )
    set_.add_argument("--json", action="store_true", help="print the stored targets as JSON")
    set_.set_defaults(func=run_set)

    show = actions.add_parser(
        "show",
        help="print stored targets",
        description=SHOW_HELP,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_etcd_arg(show)
    show.add_argument("--model", help="only this model (an error if it has no targets)")
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    show.set_defaults(func=run_show)

    delete = actions.add_parser(
        "delete",
        help="remove a model's targets (the planner stops sizing it)",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_etcd_arg(delete)
    delete.add_argument("--model", required=True, help="served model name")
    delete.set_defaults(func=run_delete)


def merged_targets(args: argparse.Namespace, stored: SLOTargets | None) -> SLOTargets:
    """``stored`` with the fields given on the command line replaced; ValueError if invalid."""
    fields = msgspec.to_builtins(stored) if stored is not None else {"model": args.model}
    given = {
        "ttft_p90_s": args.ttft_p90,
        "itl_p90_s": args.itl_p90,
        "min_prefill_replicas": args.min_prefill,
        "max_prefill_replicas": args.max_prefill,
        "min_decode_replicas": args.min_decode,
        "max_decode_replicas": args.max_decode,
    }
    fields.update({name: value for name, value in given.items() if value is not None})
    if hasattr(args, "e2e_p90"):
        fields["e2e_p90_s"] = args.e2e_p90
    missing = [flag for flag, name in (("--ttft-p90", "ttft_p90_s"), ("--itl-p90", "itl_p90_s")) if name not in fields]
    if missing:
        raise ValueError(f"model {args.model!r} has no targets yet: {' and '.join(missing)} required")
    return SLOTargets(**fields)


def run_set(args: argparse.Namespace) -> int:
    async def body(client: aetcd.Client) -> int:
        try:
            stored = await get_slo(client, args.model)
        except ValueError as error:  # a bad value: replace it only when the flags say it all
            if args.ttft_p90 is None or args.itl_p90 is None:
                raise OperationFailed(f"{error}; give --ttft-p90 and --itl-p90 to replace it") from None
            stored = None
        targets = merged_targets(args, stored)
        await put_slo(client, targets)
        if args.json:
            print_json(msgspec.to_builtins(targets))
        else:
            print(f"stored at {slo_key(args.model)}:")
            print(slo_table([targets]))
        return 0

    return run_with_etcd(args, body)


def run_show(args: argparse.Namespace) -> int:
    async def body(client: aetcd.Client) -> int:
        if args.model is not None:
            try:
                targets = await get_slo(client, args.model)
            except ValueError as error:
                raise OperationFailed(str(error)) from None
            if targets is None:
                raise OperationFailed(
                    f"no SLO for model {args.model!r} in etcd at {args.etcd}; set one with: "
                    f"pdserve slo set --model {args.model} --ttft-p90 500ms --itl-p90 30ms"
                )
            all_targets = [targets]
        else:
            all_targets = await list_slos(client)
        if args.json:
            values = [msgspec.to_builtins(t) for t in all_targets]
            print_json(values[0] if args.model is not None else values)
        elif all_targets:
            print(slo_table(all_targets))
        else:
            print(f"no SLO targets stored in etcd at {args.etcd}")
        return 0

    return run_with_etcd(args, body)


def run_delete(args: argparse.Namespace) -> int:
    async def body(client: aetcd.Client) -> int:
        if not await delete_slo(client, args.model):
            raise OperationFailed(f"no SLO for model {args.model!r} in etcd at {args.etcd}")
        print(f"deleted {slo_key(args.model)}")
        return 0

    return run_with_etcd(args, body)


def slo_table(all_targets: list[SLOTargets], indent: str = "") -> str:
    rows = [
        [
            t.model,
            fmt_seconds(t.ttft_p90_s),
            fmt_seconds(t.itl_p90_s),
            fmt_seconds(t.e2e_p90_s),
            f"{t.min_prefill_replicas}..{t.max_prefill_replicas}",
            f"{t.min_decode_replicas}..{t.max_decode_replicas}",
        ]
        for t in all_targets
    ]
    return table(["MODEL", "TTFT_P90", "ITL_P90", "E2E_P90", "PREFILL", "DECODE"], rows, indent)
