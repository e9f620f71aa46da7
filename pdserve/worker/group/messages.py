"""What rank 0 of a serving group and its other ranks tell each other about KV transfers.

The step plans go over the group's ``Channel``; these go over one TCP connection per rank
(``GroupLink`` on rank 0, ``RankService`` on the others), so that a KV pull or a completion
notice never waits for a step, nor a step for a pull. Each message is a tagged msgspec struct,
framed by its length; nothing is pickled.
"""

from __future__ import annotations

import asyncio
import struct

import msgspec

from pdserve.kvtransfer import PeerInfo

_LENGTH = struct.Struct("!I")
MAX_MESSAGE_BYTES = 64 * 2**20  # a pull order lists a request's blocks: far below this


class RankHello(msgspec.Struct, frozen=True, tag="hello"):
    """A rank's first message: its NIXL agent's metadata, which rank 0 publishes."""

    rank: int
    peer: PeerInfo


class PullOrder(msgspec.Struct, frozen=True, tag="pull"):
    """Rank 0 to a decode rank: pull ``request_id``'s KV (its heads) into the same blocks
    rank 0 pulls into, from the prefill group ``peers`` (in TP-rank order)."""

    order_id: int
    request_id: str
    peers: list[PeerInfo]
    remote_block_ids: list[int]
    local_block_ids: list[int]
    num_cached_blocks: int
    deadline_s: float


class PullDone(msgspec.Struct, frozen=True, tag="pulled"):
    """A decode rank's answer to a ``PullOrder``: its pull has ended (no transfer still writes)."""

    order_id: int
    ok: bool
    reason: str | None = None
    num_bytes: int = 0
    num_descriptors: int = 0
    num_transfers: int = 0


class ForgetPeers(msgspec.Struct, frozen=True, tag="forget"):
    """Rank 0 to a decode rank: these prefill agents left the registry; fail their pulls now."""

    names: list[str]


class ExpectNotices(msgspec.Struct, frozen=True, tag="expect"):
    """Rank 0 to a prefill rank: ``request_id``'s blocks are pinned for ``within_s``; fetch
    completion notices for it until then (an idle rank fetches none)."""

    request_id: str
    within_s: float


class RankSent(msgspec.Struct, frozen=True, tag="sent"):
    """A prefill rank to rank 0: every decode rank that reads from it is done with the request."""

    request_id: str


class RankAlive(msgspec.Struct, frozen=True, tag="alive"):
    """A rank to rank 0, every ``ALIVE_INTERVAL_S``: its process runs. A rank that is stopped or
    hung falls silent, which its link alone can tell rank 0 while no step or pull involves it."""


ALIVE_INTERVAL_S = 1.0

Message = RankHello | PullOrder | PullDone | ForgetPeers | ExpectNotices | RankSent | RankAlive
_decoder = msgspec.msgpack.Decoder(Message)


def write_message(writer: asyncio.StreamWriter, message: Message) -> None:
    """Queue ``message`` on ``writer`` in one piece, so that concurrent writers never interleave."""
    payload = msgspec.msgpack.encode(message)
    writer.write(_LENGTH.pack(len(payload)) + payload)


async def read_message(reader: asyncio.StreamReader) -> Message | None:
    """The next message, or None at the end of the stream (the other rank closed or died)."""
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if length > MAX_MESSAGE_BYTES:
            raise ValueError(f"a group message of {length} bytes exceeds {MAX_MESSAGE_BYTES}")
        return _decoder.decode(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
