"""Expert-parallel load balancing: re-place hot experts between steps, while serving.

Every expert-parallel MoE layer counts the tokens routed to each expert. Every
``eplb_interval_steps`` model steps (counted the same on every rank, since every rank takes part
in every step) the ranks sum the counts, each computes the same new placement from them
(``ExpertPlacement.rebalanced``: redundant replicas for the hottest experts, slots dealt to even
out the ranks' load), and the expert weights a rank now needs but does not hold come from the
lowest rank that held them, point to point. Tokens never change: a replica is an exact copy.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from pdserve.distributed.parallel_state import ParallelState
from pdserve.model.nn.base import DecoderModel
from pdserve.model.nn.expert_placement import ExpertPlacement
from pdserve.model.nn.moe import MoE

logger = logging.getLogger("pdserve.model.eplb")


def rebalance(model: DecoderModel, parallel: ParallelState) -> int:
    """Re-place every expert-parallel MoE layer's experts by their load since the last call.

    Every rank of the group calls it at the same step. Returns how many expert copies moved
    between ranks (0 when every placement already fitted its load).
    """
    moved = 0
    for index, layer in enumerate(model.layers):
        moe = layer.feed_forward
        if not isinstance(moe, MoE) or not moe.expert_parallel:
            continue
        load = parallel.ep_all_reduce(moe.load.clone())
        moe.load.zero_()
        placement = moe.placement.rebalanced(load)
        if placement == moe.placement:
            continue
        weights, count = _exchange(moe, placement, parallel)
        moe.place(placement, weights)
        moved += count
        logger.debug("layer %d: experts re-placed by load %s, %d copies moved", index, load.tolist(), count)
    return moved


def _exchange(moe: MoE, new: ExpertPlacement, parallel: ParallelState) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    """This rank's weights for ``new``: kept where it held them, received where it did not."""
    old = moe.placement
    me, ranks = parallel.ep_rank, parallel.ep_size
    held = [old.rank_slots(r) for r in range(ranks)]
    wanted = [new.rank_slots(r) for r in range(ranks)]
    # Each expert a rank lacks comes from the lowest rank that held it; a rank needing one
    # expert in two slots receives it once.
    transfers = sorted({(_source(held, e), r, e) for r in range(ranks) for e in wanted[r] if e not in held[r]})
    received: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    ops = []
    for src, dst, expert in transfers:
        if src == me:
            local = held[me].index(expert)
            ops.append(dist.P2POp(dist.isend, moe.w13[local].contiguous(), dst, tag=2 * expert))
            ops.append(dist.P2POp(dist.isend, moe.w2[local].contiguous(), dst, tag=2 * expert + 1))
        elif dst == me:
            buffers = (torch.empty_like(moe.w13[0]), torch.empty_like(moe.w2[0]))
            received[expert] = buffers
            ops.append(dist.P2POp(dist.irecv, buffers[0], src, tag=2 * expert))
            ops.append(dist.P2POp(dist.irecv, buffers[1], src, tag=2 * expert + 1))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def weights_of(expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        if expert in held[me]:
            local = held[me].index(expert)
            return moe.w13[local], moe.w2[local]
        return received[expert]

    pairs = [weights_of(e) for e in wanted[me]]
    return (torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])), len(transfers)


def _source(held: list[tuple[int, ...]], expert: int) -> int:
    return next(r for r, slots in enumerate(held) if expert in slots)
