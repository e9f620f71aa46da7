"""Move paged KV blocks between worker processes with NIXL.

- ``layout``: ``KVLayout`` / ``check_compatible``: the layout descriptor, checked before anything moves;
- ``agent``: ``KVAgent``, the process's NIXL agent (registration, peers, the NIXL thread);
- ``pull``: ``KVPuller``, decode side — pull a request's blocks, then notify the prefill ranks;
- ``sent``: ``SentReporter``, prefill side — report a request "sent" once its decode ranks' notices are in;
- ``stats``: ``TransferStats``, what one pull moved;
- ``descriptors``: ``SliceDescriptors``, NIXL descriptor lists prepared once per peer, and a pull's indices;
- ``tp``: heterogeneous tensor parallelism: which prefill ranks a decode rank reads (``sources``) and notifies;
- ``messages``: ``PeerInfo`` and ``CompletionNotice``, the msgpack messages that cross processes.
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
