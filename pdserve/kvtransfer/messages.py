"""Typed messages that cross process boundaries: peer metadata and completion notices.

Everything here is a msgspec Struct encoded as msgpack; nothing is pickled. ``PeerInfo`` is
what a worker publishes (its registry entry in etcd, or its endpoint on first contact);
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
