"""``pdserve knobs set|show|reset``: a model's live scheduler and router settings, in etcd."""

from __future__ import annotations

import argparse
import sys

import aetcd
import msgspec

from pdserve.cli.operate import EXIT_STATUS, OperationFailed, add_etcd_arg, print_json, run_with_etcd, table
from pdserve.discovery.knobs import Knobs, delete_knobs, get_knobs, list_knobs, put_knobs
from pdserve.discovery.registry import Role, WorkerEntry, knobs_key, list_workers
from pdserve.discovery.slo_store import get_slo
from pdserve.observability.frontend_stats import list_frontend_stats
from pdserve.planner.deployed_knobs import deployed_knobs

DESCRIPTION = """A model's knobs: settings that trade TTFT against ITL without new hardware,
applied live (within milliseconds, by etcd watch, no restart) by its workers and every frontend:

  decode_max_num_seqs            most requests a decode worker runs at once
  decode_max_num_batched_tokens  a decode worker's token budget per step
  prefill_chunk_size             a prefill worker's token budget per step (chunked prefill)
  local_prefill_threshold_tokens prompts with at most this many uncached tokens are prefilled
                                 on the decode worker (frontends routing --disaggregation
                                 conditional; 0 sends every prompt to the prefill pool)

Stored as JSON at /pdserve/v1/knobs/MODEL. A worker never goes above the budget it was started
with (--max-num-seqs, --max-num-batched-tokens): its engine reserved memory for that. With no
stored knobs every component runs with its start-up settings. The planner (`pdserve planner`,
`pdserve up --autoscale`) writes these knobs itself when it retunes a model with an SLO."""

EXAMPLES = f"""examples:
  pdserve knobs show
  pdserve knobs set --model llama --decode-max-num-seqs 16        # change one, keep the rest
  pdserve knobs set --model llama --local-prefill-threshold 256 --json
  pdserve knobs reset --model llama                               # back to start-up settings
{EXIT_STATUS}
"""

SET_HELP = """Change a model's knobs. Flags not given keep their stored values, or, with none
stored, the settings its workers and frontends were started with. Prints what was stored."""

SHOW_HELP = """Print each model's knobs in force: the stored ones, or the start-up settings of a
model whose workers are registered and which has none stored."""

_FLAGS = {
    "decode_max_num_seqs": "--decode-max-num-seqs",
    "decode_max_num_batched_tokens": "--decode-max-num-batched-tokens",
    "prefill_chunk_size": "--prefill-chunk-size",
    "local_prefill_threshold_tokens": "--local-prefill-threshold",
}


def add_parser(commands: argparse._SubParsersAction) -> None:
    knobs = commands.add_parser(
        "knobs",
        help="set or show a model's live scheduler and router settings",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = knobs.add_subparsers(dest="action", required=True, metavar="ACTION")

    set_ = actions.add_parser(
        "set",
        help="change a model's knobs",
        description=SET_HELP,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_etcd_arg(set_)
    set_.add_argument("--model", required=True, help="served model name, as workers register it")
    for field, flag in _FLAGS.items():
        set_.add_argument(flag, dest=field, type=int, metavar="N", help=f"{field} (default: keep)")
    set_.add_argument("--json", action="store_true", help="print the stored knobs as JSON")
    set_.set_defaults(func=run_set)

    show = actions.add_parser(
        "show",
        help="print the knobs in force",
        description=SHOW_HELP,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_etcd_arg(show)
    show.add_argument("--model", help="only this model")
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    show.set_defaults(func=run_show)

    reset = actions.add_parser(
        "reset",
        help="delete a model's knobs: back to start-up settings",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_etcd_arg(reset)
    reset.add_argument("--model", required=True, help="served model name")
    reset.set_defaults(func=run_reset)


async def _stored(client: aetcd.Client, model: str) -> Knobs | None:
    try:
        return await get_knobs(client, model)
    except ValueError as error:  # a bad value: `set` replaces it
        print(f"note: {error}; replacing it", file=sys.stderr)
        return None


def run_set(args: argparse.Namespace) -> int:
    async def body(client: aetcd.Client) -> int:
        workers = await list_workers(client)
        base = await _stored(client, args.model)
        if base is None:
            base = deployed_knobs(args.model, workers, await list_frontend_stats(client))
        given = {field: getattr(args, field) for field in _FLAGS if getattr(args, field) is not None}
        if not given:
            raise ValueError(f"nothing to set: give at least one of {', '.join(_FLAGS.values())}")
        knobs = Knobs(**{**msgspec.to_builtins(base), **given})
        await put_knobs(client, args.model, knobs)
        if args.json:
            print_json(msgspec.to_builtins(knobs))
            return 0
        print(f"stored at {knobs_key(args.model)}:")
        print(knobs_table({args.model: (knobs, "stored")}))
        for note in _capped(knobs, [w for w in workers if w.model == args.model]):
            print(f"note: {note}")
        if await _has_slo(client, args.model):
            print(f"note: {args.model} has an SLO: a running planner may retune these knobs at its next decision")
        return 0

    return run_with_etcd(args, body)


async def _has_slo(client: aetcd.Client, model: str) -> bool:
    try:
        return await get_slo(client, model) is not None
    except ValueError:  # a bad SLO value is `pdserve slo`'s to report
        return True


def _capped(knobs: Knobs, workers: list[WorkerEntry]) -> list[str]:
    """What the registered workers will cap, because they were started with less."""
    notes = []
    for role, field, limit_of in (
        (Role.DECODE, "decode_max_num_seqs", lambda w: w.max_num_seqs),
        (Role.DECODE, "decode_max_num_batched_tokens", lambda w: w.max_num_batched_tokens),
        (Role.PREFILL, "prefill_chunk_size", lambda w: w.max_num_batched_tokens),
    ):
        limits = [limit_of(w) for w in workers if w.role == role and limit_of(w)]
        if limits and getattr(knobs, field) > min(limits):
            notes.append(
                f"{field} {getattr(knobs, field)} is capped at {min(limits)} on {role} workers started with less"
            )
    return notes


def run_show(args: argparse.Namespace) -> int:
    async def body(client: aetcd.Client) -> int:
        stored = await list_knobs(client)
        workers = await list_workers(client)
        frontends = await list_frontend_stats(client)
        rows: dict[str, tuple[Knobs, str]] = {model: (knobs, "stored") for model, knobs in stored.items()}
        for model in {w.model for w in workers} - set(stored):
            rows[model] = (deployed_knobs(model, workers, frontends), "start-up")
        if args.model is not None:
            if args.model not in rows:
                raise OperationFailed(
                    f"no knobs for model {args.model!r} in etcd at {args.etcd}, and no worker serves it"
                )
            rows = {args.model: rows[args.model]}
        if args.json:
            values = [{"model": m, "source": src, **msgspec.to_builtins(k)} for m, (k, src) in sorted(rows.items())]
            print_json(values[0] if args.model is not None else values)
        elif rows:
            print(knobs_table(rows))
        else:
            print(f"no knobs stored and no workers registered in etcd at {args.etcd}")
        return 0

    return run_with_etcd(args, body)


def run_reset(args: argparse.Namespace) -> int:
    async def body(client: aetcd.Client) -> int:
        if not await delete_knobs(client, args.model):
            raise OperationFailed(f"no knobs stored for model {args.model!r} in etcd at {args.etcd}")
        print(f"deleted {knobs_key(args.model)}: {args.model} runs with its start-up settings")
        return 0

    return run_with_etcd(args, body)


def knobs_table(rows: dict[str, tuple[Knobs, str]], indent: str = "") -> str:
    """One row per model: where its knobs come from, then each knob."""
    lines = [
        [
            model,
            source,
            k.decode_max_num_seqs,
            k.decode_max_num_batched_tokens,
            k.prefill_chunk_size,
            k.local_prefill_threshold_tokens,
        ]
        for model, (k, source) in sorted(rows.items())
    ]
    headers = ["MODEL", "SOURCE", "DECODE_SEQS", "DECODE_TOKENS", "PREFILL_CHUNK", "LOCAL_PREFILL"]
    return table(headers, lines, indent)
