"""Typed messages that cross process boundaries: peer metadata and completion notices.

Everything here is a msgspec Struct encoded as msgpack; nothing is pickled. ``PeerInfo`` is
what a worker's rank publishes (a group's ranks together, ``encode_group``, in its registry
entry in etcd);
``CompletionNotice`` travels as a NIXL notification from a decode rank to a prefill rank.
"""

from __future__ import annotations

import msgspec

from pdserve.kvtransfer.layout import KVLayout


class PeerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a peer needs to read this worker's KV pool.

    ``base_address`` is the start of the registered pool in this process (NIXL descriptors
    carry absolute addresses); ``num_blocks`` bounds the block ids a reader may ask for.
    """

    agent_name: str
    agent_metadata: bytes
    layout: KVLayout
    base_address: int
    num_blocks: int
    mem_type: str = "DRAM"  # NIXL memory type of the pool: "DRAM" or "VRAM"
    device_id: int = 0  # GPU index for VRAM

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(data: bytes) -> PeerInfo:
        return msgspec.msgpack.decode(data, type=PeerInfo)


def encode_group(peers: list[PeerInfo]) -> bytes:
    """What a worker publishes as its NIXL metadata: its one ``PeerInfo`` for a single rank
    (as before groups existed), else every rank's, in TP-rank order."""
    return peers[0].encode() if len(peers) == 1 else msgspec.msgpack.encode(peers)


_group_decoder = msgspec.msgpack.Decoder(PeerInfo | list[PeerInfo])


def decode_group(data: bytes) -> list[PeerInfo]:
    """The ranks ``encode_group`` wrote, in TP-rank order; raises ``msgspec.DecodeError``."""
    decoded = _group_decoder.decode(data)
    peers = decoded if isinstance(decoded, list) else [decoded]
    if not peers:
        raise msgspec.DecodeError("no NIXL peer in the group's metadata")
    return peers


class CompletionNotice(msgspec.Struct, frozen=True, tag="pdserve.kv.done"):
    """A decode rank is done with a request's blocks on the receiving prefill rank.

    Sent whether the pull succeeded, needed nothing (full prefix hit) or gave up: in every
    case the prefill side may free. ``num_expected`` is how many distinct decode ranks will
    notify this receiver for the request; it frees when all have.
    """

    request_id: str
    sender_rank: int
    num_expected: int
    ok: bool
    reason: str | None = None

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)


_notice_decoder = msgspec.msgpack.Decoder(CompletionNotice)


def decode_notice(data: bytes) -> CompletionNotice | None:
    """The notice in ``data``, or None if it is not one of ours (other users of the agent)."""
    try:
        return _notice_decoder.decode(data)
    except msgspec.DecodeError:
        return None
