"""The options that place a worker's rank in a group across hosts (``--leader-address``,
``--group-size``, ``--group-index``), and their fallback: a LeaderWorkerSet's variables."""

from __future__ import annotations

import argparse

from pdserve import environment
from pdserve.cli.common import add_field_option, duration
from pdserve.distributed.parallel_config import ParallelConfig
from pdserve.distributed.placement import RENDEZVOUS_PORT, GroupPlacement, placement_from


def add_group_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "a group across hosts",
        "Run one rank of a group whose ranks are separate processes, possibly on other hosts, that "
        "meet at the leader's address (rank 0's). Without these options rank 0 starts the other "
        "ranks itself on this host. A LeaderWorkerSet's pods need none of them: its variables "
        "LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX are read instead (options win). "
        "Give every rank the same options but --group-index, and a --host (or --advertise-host) "
        "the other ranks can reach.",
    )
    group.add_argument(
        "--leader-address",
        metavar="HOST[:PORT]",
        help=f"where rank 0 listens for the group's rendezvous (default port {RENDEZVOUS_PORT})",
    )
    group.add_argument("--group-size", type=int, metavar="N", help="the group's ranks: TP x DP")
    group.add_argument("--group-index", type=int, metavar="I", help="this process's rank, 0 being the leader")
    add_field_option(
        group,
        "--rendezvous-timeout",
        ParallelConfig,
        "rendezvous_timeout_s",
        type=duration,
        help="how long the ranks wait for each other to start, on one host or several "
        "(default: {default:g}s; raise it where the ranks' hosts start far apart)",
    )
    add_field_option(
        group,
        "--collective-timeout",
        ParallelConfig,
        "collective_timeout_s",
        type=duration,
        help="longest one collective may take: a rank silent for longer (hung, stopped, cut off) fails "
        "the whole group (default: {default:g}s)",
    )


def group_placement(args: argparse.Namespace) -> GroupPlacement | None:
    """The rank's place from ``--leader-address``, ``--group-size`` and ``--group-index``, or else
    from a LeaderWorkerSet's variables; None for the one-host mode."""
    flags = (args.leader_address, args.group_size, args.group_index)
    if any(value is not None for value in flags):
        return placement_from(*flags, source="--leader-address, --group-size, --group-index")
    names = environment.GROUP_SETTINGS
    values = {setting: environment.group_setting(setting) for setting in names}
    numbers: dict[str, int | None] = {}
    for setting in ("group_size", "group_index"):
        text = values[setting]
        if text is not None and not text.strip().isdigit():
            raise ValueError(f"${names[setting]} must be a whole number, got {text!r}")
        numbers[setting] = None if text is None else int(text)
    return placement_from(
        values["leader_address"],
        numbers["group_size"],
        numbers["group_index"],
        source=", ".join(f"${name}" for name in names.values()),
    )
