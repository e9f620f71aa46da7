"""Move paged KV blocks between worker processes with NIXL.

- ``KVLayout`` / ``check_compatible``: the layout descriptor, checked before anything moves.
- ``KVAgent``: the process's NIXL agent (registration, peers, the NIXL thread).
- ``KVPuller``: decode side — pull a request's blocks, then notify the prefill ranks.
- ``BlockHolder``: prefill side — pin blocks until notified or a deadline passes.
- ``TransferStats``: what one pull moved.
"""

from pdserve.kvtransfer.agent import KVAgent, PeerGone, XferError
from pdserve.kvtransfer.hold import BlockHolder
from pdserve.kvtransfer.layout import PROTOCOL_VERSION, KVLayout, LayoutMismatch, check_compatible
from pdserve.kvtransfer.messages import CompletionNotice, PeerInfo
from pdserve.kvtransfer.pull import KVPuller, TransferFailed
from pdserve.kvtransfer.stats import TransferStats

__all__ = [
    "PROTOCOL_VERSION",
    "BlockHolder",
    "CompletionNotice",
    "KVAgent",
    "KVLayout",
    "KVPuller",
    "LayoutMismatch",
    "PeerGone",
    "PeerInfo",
    "TransferFailed",
    "TransferStats",
    "XferError",
    "check_compatible",
]
