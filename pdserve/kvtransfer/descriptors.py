"""Prepared NIXL descriptor lists for one (peer, head slice), and the indices of a pull.

A pull must not rebuild descriptors: both sides' lists are prepared once per peer
(``prep_xfer_dlist``) and every transfer picks entries by index (``make_prepped_xfer``).

Two shapes, decided by whether the bytes to read are contiguous per block on both sides:

- **whole blocks** (MLA, or GQA with the same heads on both sides): one block, all layers, is
  one contiguous range. Runs of consecutive blocks (consecutive on both sides) are coalesced
  into single descriptors: the lists hold, for each power-of-two run length ``2**k`` up to
  ``max_run_blocks``, one entry per start block, and a run of ``n`` blocks becomes at most
  ``popcount(n)`` entries (plus one per ``max_run_blocks``).
- **head slices** (heterogeneous GQA TP): a rank reads a run of heads of every layer's K and V
  — ``[num_heads, block_size, head_dim]`` at a stride of the side's ``H * block_size *
  head_dim``; one entry per (block, layer, K/V). Neighbouring entries are never contiguous on
  both sides (one side is strided by construction), so there is nothing to coalesce.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from nixl._api import nixl_agent

from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.messages import PeerInfo
from pdserve.kvtransfer.tp import HeadSlice


class SliceDescriptors:
    """Both sides' prepared lists for reading ``head_slice`` of peer ``remote``'s blocks.

    Build with ``SliceDescriptors.build`` on the NIXL thread; ``release`` (NIXL thread) frees
    the two prepared lists. ``indices`` is pure and cheap (numpy over the request's blocks).
    """

    def __init__(
        self,
        local: PeerInfo,
        remote: PeerInfo,
        head_slice: HeadSlice,
        max_run_blocks: int = 64,
    ) -> None:
        self.remote_name = remote.agent_name
        self.head_slice = head_slice
        self.local_num_blocks = local.num_blocks
        self.remote_num_blocks = remote.num_blocks
        lay_l, lay_r = local.layout, remote.layout
        n = head_slice.num_heads
        self.whole_blocks = n is None or (n == lay_l.num_kv_heads == lay_r.num_kv_heads)
        if self.whole_blocks:
            if lay_l.bytes_per_block != lay_r.bytes_per_block:
                raise ValueError("whole-block reads need equal block sizes on both sides")
            self.bytes_per_pair = lay_l.bytes_per_block
            limit = min(max_run_blocks, local.num_blocks, remote.num_blocks)
            self.run_lengths = [1 << k for k in range(limit.bit_length()) if (1 << k) <= limit]
            self.local_rows, self.local_offsets = _run_rows(local, self.run_lengths)
            self.remote_rows, self.remote_offsets = _run_rows(remote, self.run_lengths)
        else:
            assert n is not None
            self.units_per_block = 2 * lay_l.num_layers  # one per (layer, K/V)
            self.bytes_per_pair = self.units_per_block * n * lay_l.bytes_per_head_slab
            self.local_rows = _slice_rows(local, head_slice.local_head, n)
            self.remote_rows = _slice_rows(remote, head_slice.remote_head, n)
        self.local_handle: Any = None
        self.remote_handle: Any = None

    @classmethod
    def build(
        cls, nx: nixl_agent, local: PeerInfo, remote: PeerInfo, head_slice: HeadSlice, max_run_blocks: int = 64
    ) -> SliceDescriptors:
        """Compute and prepare both lists (call on the NIXL thread)."""
        descs = cls(local, remote, head_slice, max_run_blocks)
        descs.local_handle = nx.prep_xfer_dlist("", descs.local_rows, local.mem_type)
        try:
            descs.remote_handle = nx.prep_xfer_dlist(remote.agent_name, descs.remote_rows, remote.mem_type)
        except Exception:
            descs.local_handle.release()
            raise
        return descs

    def release(self, _: nixl_agent | None = None) -> None:
        """Free the prepared lists (NIXL thread)."""
        for handle in (self.local_handle, self.remote_handle):
            if handle is not None:
                handle.release()
        self.local_handle = self.remote_handle = None

    def indices(self, remote_ids: np.ndarray, local_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """``(local_indices, remote_indices, num_bytes)`` reading ``remote_ids[i]`` into ``local_ids[i]``."""
        if len(remote_ids) != len(local_ids):
            raise ValueError("one local block per remote block")
        if len(remote_ids) and (remote_ids.min() < 0 or remote_ids.max() >= self.remote_num_blocks):
            raise ValueError(f"remote block id outside the peer's {self.remote_num_blocks} blocks")
        if len(local_ids) and (local_ids.min() < 0 or local_ids.max() >= self.local_num_blocks):
            raise ValueError(f"local block id outside the pool's {self.local_num_blocks} blocks")
        num_bytes = len(remote_ids) * self.bytes_per_pair
        if not self.whole_blocks:
            units = np.arange(self.units_per_block, dtype=np.int64)
            local_idx = (local_ids[:, None] * self.units_per_block + units).reshape(-1)
            remote_idx = (remote_ids[:, None] * self.units_per_block + units).reshape(-1)
            return local_idx.astype(np.int32), remote_idx.astype(np.int32), num_bytes
        local_out: list[int] = []
        remote_out: list[int] = []
        for r_start, l_start, length in coalesce(remote_ids, local_ids):
            while length:
                level = min(length.bit_length(), len(self.run_lengths)) - 1
                run = self.run_lengths[level]
                local_out.append(self.local_offsets[level] + l_start)
                remote_out.append(self.remote_offsets[level] + r_start)
                r_start, l_start, length = r_start + run, l_start + run, length - run
        return np.asarray(local_out, np.int32), np.asarray(remote_out, np.int32), num_bytes


def coalesce(remote_ids: np.ndarray, local_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs ``(remote_start, local_start, length)`` consecutive on both sides, in order."""
    if len(remote_ids) == 0:
        return []
    step = (np.diff(remote_ids) != 1) | (np.diff(local_ids) != 1)
    starts = np.concatenate(([0], np.nonzero(step)[0] + 1))
    lengths = np.diff(np.concatenate((starts, [len(remote_ids)])))
    return [(int(remote_ids[s]), int(local_ids[s]), int(n)) for s, n in zip(starts.tolist(), lengths.tolist())]


# Rows are explicit (address, length, device) triples: NIXL's compressed strided rows reject
# overlapping entries, which the run lists are by design (a block starts runs of every length).
def _run_rows(side: PeerInfo, run_lengths: list[int]) -> tuple[np.ndarray, list[int]]:
    """For each run length, one entry per start block; and where each length's entries begin."""
    stride = side.layout.bytes_per_block
    parts, offsets, offset = [], [], 0
    for run in run_lengths:
        starts = np.arange(side.num_blocks - run + 1, dtype=np.uint64)
        part = np.empty((len(starts), 3), dtype=np.uint64)
        part[:, 0] = side.base_address + starts * stride
        part[:, 1] = run * stride
        part[:, 2] = side.device_id
        parts.append(part)
        offsets.append(offset)
        offset += len(starts)
    return np.concatenate(parts), offsets


def _slice_rows(side: PeerInfo, first_head: int, num_heads: int) -> np.ndarray:
    """Per block, per (layer, K/V): heads ``[first_head, first_head + num_heads)``."""
    lay: KVLayout = side.layout
    slab = lay.bytes_per_head_slab
    units = np.arange(2 * lay.num_layers, dtype=np.uint64) * (lay.num_kv_heads * slab)
    blocks = np.arange(side.num_blocks, dtype=np.uint64) * lay.bytes_per_block
    rows = np.empty((side.num_blocks * len(units), 3), dtype=np.uint64)
    rows[:, 0] = (side.base_address + first_head * slab + blocks[:, None] + units[None, :]).reshape(-1)
    rows[:, 1] = num_heads * slab
    rows[:, 2] = side.device_id
    return rows
