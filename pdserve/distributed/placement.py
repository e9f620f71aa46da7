"""Where a rank of a group stands when the group spans hosts: one struct, checked on construction.

A group runs in one of two modes. Without a placement, rank 0 starts ranks 1..N-1 itself as
child processes on its own host (the one-host shortcut). With one, every rank is a process of
its own, possibly on another host, started by whoever deploys the group (a LeaderWorkerSet,
a StatefulSet, a person), and told three things: the leader's address, the group's size and
its own index. The ranks meet at the leader's rendezvous port; from there on both modes run
the same code.

The three facts come from flags (``--leader-address``, ``--group-size``, ``--group-index``) or
from the environment a LeaderWorkerSet gives its pods (``LWS_LEADER_ADDRESS``,
``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``); ``placement_from`` joins the two, flags first.
msgspec and the standard library only: the CLI builds it before torch loads.
"""

from __future__ import annotations

import msgspec

# The leader's rendezvous port when the address names none (torch.distributed's customary one).
RENDEZVOUS_PORT = 29500


class GroupPlacement(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """This process's rank in a group whose ranks are started separately.

    leader_host / leader_port: where rank 0 listens for the group's rendezvous (rank 0 itself
        listens on every address at that port).
    group_size: the group's ranks; must equal tensor_parallel_size x data_parallel_size.
    group_index: this process's rank, 0 being the leader.
    """

    leader_host: str
    group_size: int
    group_index: int
    leader_port: int = RENDEZVOUS_PORT

    def __post_init__(self) -> None:
        if not self.leader_host:
            raise ValueError("leader address must not be empty")
        if self.group_size < 1:
            raise ValueError(f"group size must be >= 1, got {self.group_size}")
        if not 0 <= self.group_index < self.group_size:
            raise ValueError(
                f"group index {self.group_index} is out of range for a group of {self.group_size} ranks "
                f"(0..{self.group_size - 1})"
            )
        if not 0 < self.leader_port < 65536:
            raise ValueError(f"leader port must be in [1, 65535], got {self.leader_port}")

    @property
    def is_leader(self) -> bool:
        return self.group_index == 0

    @property
    def leader_address(self) -> str:
        return f"{self.leader_host}:{self.leader_port}"


def parse_leader_address(address: str) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT`` or ``[IPv6]:PORT`` as (host, port); the port defaults to ``RENDEZVOUS_PORT``."""
    text = address.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, ""
    if not host:
        raise ValueError(f"leader address {address!r} names no host")
    if not port_text:
        return host, RENDEZVOUS_PORT
    if not port_text.isdigit():
        raise ValueError(f"leader address {address!r}: port {port_text!r} is not a number")
    return host, int(port_text)


def placement_from(
    leader_address: str | None, group_size: int | None, group_index: int | None, *, source: str
) -> GroupPlacement | None:
    """The placement these settings give, or None when none is set (the one-host mode).

    Either all three are set or none: a partial set is a mistake that would otherwise start a
    group of one. ``source`` names where they came from, for the error."""
    given = {"leader address": leader_address, "group size": group_size, "group index": group_index}
    if all(value is None for value in given.values()):
        return None
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise ValueError(
            f"{source}: a group across hosts needs the leader address, group size and group "
            f"index together; missing {', '.join(missing)}"
        )
    assert leader_address is not None and group_size is not None and group_index is not None
    host, port = parse_leader_address(leader_address)
    return GroupPlacement(leader_host=host, leader_port=port, group_size=group_size, group_index=group_index)
