"""Heterogeneous tensor parallelism: which prefill ranks a decode rank reads, and notifies.

GQA: rank ``r`` of a group of size ``t`` holds the global KV heads
``[r * H / t, (r + 1) * H / t)``. A decode rank reads the intersection of its heads with each
prefill rank's heads — one contiguous run of heads on both sides, since both are intervals.
That covers p < d (a slice of one prefill rank), p == d (all of one rank) and p > d (all of
several ranks, each into a slice of the decode rank's heads).

MLA: the latent is replicated, so a decode rank reads whole blocks from one prefill rank
(``r % p``, spreading the load), yet every prefill rank pins the blocks and must be told when
to free them: the notify sets below cover every prefill rank, and each notice carries how
many notices its receiver should wait for.
"""

from __future__ import annotations

import msgspec

from pdserve.kvtransfer.layout import KVLayout


class HeadSlice(msgspec.Struct, frozen=True):
    """Read heads ``[remote_head, remote_head + num_heads)`` of prefill rank ``remote_rank``
    into local heads ``[local_head, local_head + num_heads)``. ``num_heads`` is None for MLA
    (whole blocks)."""

    remote_rank: int
    remote_head: int
    local_head: int
    num_heads: int | None


def _heads(rank: int, size: int, total: int) -> tuple[int, int]:
    per_rank = total // size
    return rank * per_rank, (rank + 1) * per_rank


def sources(local: KVLayout, remote_tp_size: int) -> list[HeadSlice]:
    """What decode rank ``local`` reads from a prefill group of ``remote_tp_size`` ranks."""
    if local.is_mla:
        return [HeadSlice(local.tp_rank % remote_tp_size, 0, 0, None)]
    total = local.total_kv_heads
    if total % remote_tp_size:
        raise ValueError(f"{total} KV heads do not divide over {remote_tp_size} prefill ranks")
    lo, hi = _heads(local.tp_rank, local.tp_size, total)
    slices = []
    for q in range(remote_tp_size):
        q_lo, q_hi = _heads(q, remote_tp_size, total)
        start, end = max(lo, q_lo), min(hi, q_hi)
        if start < end:
            slices.append(HeadSlice(q, start - q_lo, start - lo, end - start))
    return slices


def notify_set(local: KVLayout, remote_tp_size: int) -> list[int]:
    """Prefill ranks decode rank ``local`` sends its completion notice to.

    The union over all decode ranks covers every prefill rank (all of them pinned blocks).
    """
    r, d, p = local.tp_rank, local.tp_size, remote_tp_size
    if not local.is_mla:
        return [s.remote_rank for s in sources(local, p)]
    if p >= d:
        return [q for q in range(p) if q % d == r]
    return [r % p]


def expected_notices(remote_rank: int, local_template: KVLayout, remote_tp_size: int) -> int:
    """How many decode ranks (of ``local_template``'s group) notify prefill ``remote_rank``.

    Computed by the sender and carried in the notice, because the prefill side does not
    know the decode group's size when it pins the blocks.
    """
    count = 0
    for r in range(local_template.tp_size):
        rank_layout = msgspec.structs.replace(local_template, tp_rank=r)
        if remote_rank in notify_set(rank_layout, remote_tp_size):
            count += 1
    return count
