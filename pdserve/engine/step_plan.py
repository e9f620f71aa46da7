"""One step's model inputs as a message: what a tensor-parallel leader sends its other ranks.

The scheduler runs on the leader alone; the others hold the same block tables' worth of KV
(their own heads of it) and run exactly the batch the leader plans. The arrays travel as raw
bytes.
"""

from __future__ import annotations

import msgspec
import numpy as np


class StepPlan(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    input_ids: bytes = b""  # int64 [T]
    positions: bytes = b""  # int64 [T]
    slot_mapping: bytes = b""  # int64 [T]
    block_tables: bytes = b""  # int32 [num_seqs, table_width]
    table_width: int = 0
    seq_lens: list[int] = []
    query_lens: list[int] = []
    num_decodes: int = 0
    sample_rows: bytes = b""  # int64 [R]
    rebalance: bool = False  # re-place the experts after this step (load balancing on demand)
    idle: bool = False  # no tokens here, but data-parallel peers step: join their exchanges
    stop: bool = False  # the group is shutting down: no more steps


def array(data: bytes, dtype: type[np.generic]) -> np.ndarray:
    """A writable array over a plan's bytes."""
    return np.frombuffer(bytearray(data), dtype=dtype)


class GroupStart(msgspec.Struct, frozen=True, kw_only=True):
    """A tensor-parallel leader's first message: the facts its other ranks size their KV cache by."""

    num_blocks: int
