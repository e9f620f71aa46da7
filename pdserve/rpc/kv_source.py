"""The ``KVSource`` that tells a decode worker where a prompt's KV is, built in one place for
its two senders: the frontend, after a Prefill call, and the prefill worker itself (``KVReady``)."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.v1 import worker_pb2

# The decode worker must finish pulling this long before the prefill worker's pin runs out.
PULL_MARGIN_S = 2.0


def ready_source(
    worker_id: str, block_ids: Sequence[int], first_token_id: int, pin_left_s: float, peer_info: bytes = b""
) -> worker_pb2.KVSource:
    """The KV of ``worker_id``'s pinned ``block_ids``, to be pulled while ``pin_left_s`` lasts
    (less the margin), and the first token sampled after it."""
    return worker_pb2.KVSource(
        worker_id=worker_id,
        peer_info=peer_info,
        block_ids=block_ids,
        first_token_id=first_token_id,
        pull_within_s=max(pin_left_s - PULL_MARGIN_S, 0.0),
    )
