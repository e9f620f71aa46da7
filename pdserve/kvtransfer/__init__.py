"""Move paged KV blocks between worker processes with NIXL.

- ``KVLayout`` / ``check_compatible``: the layout descriptor, checked before anything moves.
- ``KVAgent``: the process's NIXL agent (registration, peers, the NIXL thread).
- ``KVPuller``: decode side — pull a request's blocks, then notify the prefill ranks.
- ``SentReporter``: prefill side — report a request "sent" once its decode ranks' notices are in.
- ``TransferStats``: what one pull moved.
"""

from pdserve.kvtransfer.agent import KVAgent, PeerGone, XferError
from pdserve.kvtransfer.layout import PROTOCOL_VERSION, KVLayout, LayoutMismatch, check_compatible
from pdserve.kvtransfer.messages import CompletionNotice, PeerInfo, decode_group, encode_group
from pdserve.kvtransfer.pull import KVPuller, TransferFailed
from pdserve.kvtransfer.sent import SentReporter
from pdserve.kvtransfer.stats import TransferStats

__all__ = [
    "PROTOCOL_VERSION",
    "CompletionNotice",
    "KVAgent",
    "KVLayout",
    "KVPuller",
    "LayoutMismatch",
    "PeerGone",
    "PeerInfo",
    "SentReporter",
    "TransferFailed",
    "TransferStats",
    "XferError",
    "check_compatible",
    "decode_group",
    "encode_group",
]
