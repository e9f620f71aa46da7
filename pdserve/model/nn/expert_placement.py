"""Where each expert of a MoE layer lives across the expert-parallel ranks.

A layer has ``num_experts`` logical experts and ``num_experts + num_redundant`` physical slots,
``slots_per_rank`` on each rank (rank r holds slots ``[r*S, (r+1)*S)``). Every logical expert
has at least one slot; a hot expert may have more (EPLB's redundant replicas), and each token
goes to one of its expert's replicas, picked by the token's index so the replicas share the load.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    slot_experts: tuple[int, ...]  # physical slot → logical expert
    num_experts: int
    num_ranks: int

    def __post_init__(self) -> None:
        if len(self.slot_experts) % self.num_ranks:
            raise ValueError(
                f"{len(self.slot_experts)} expert slots do not divide over {self.num_ranks} expert-parallel ranks"
            )
        if set(self.slot_experts) != set(range(self.num_experts)):
            raise ValueError("every expert needs at least one slot")

    @classmethod
    def balanced(cls, num_experts: int, num_ranks: int, num_redundant: int = 0) -> ExpertPlacement:
        """Experts in order, rank by rank; redundant slots (if any) placed as for an even load."""
        if (num_experts + num_redundant) % num_ranks:
            raise ValueError(
                f"num_experts ({num_experts}) + num_redundant_experts ({num_redundant}) must divide by the "
                f"{num_ranks} expert-parallel ranks"
            )
        if num_redundant == 0:
            return cls(tuple(range(num_experts)), num_experts, num_ranks)
        return cls(_place([1.0] * num_experts, num_experts + num_redundant, num_ranks), num_experts, num_ranks)

    @property
    def slots_per_rank(self) -> int:
        return len(self.slot_experts) // self.num_ranks

    def rank_slots(self, rank: int) -> tuple[int, ...]:
        """The logical experts rank ``rank`` holds, slot by slot."""
        s = self.slots_per_rank
        return self.slot_experts[rank * s : (rank + 1) * s]

    def replica_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(table [E, max_replicas], counts [E])``: the physical slots of each expert."""
        replicas: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, expert in enumerate(self.slot_experts):
            replicas[expert].append(slot)
        width = max(len(r) for r in replicas)
        table = torch.tensor([r + [r[0]] * (width - len(r)) for r in replicas], dtype=torch.int64)
        return table, torch.tensor([len(r) for r in replicas], dtype=torch.int64)

    def rebalanced(self, load: torch.Tensor) -> ExpertPlacement:
        """A placement for the observed ``load`` (tokens per logical expert).

        The redundant slots go, one at a time, to the expert with the most load per replica;
        then the slots are dealt to ranks heaviest first, each to the least-loaded rank with a
        free slot that does not hold that expert yet (when one exists).
        """
        return ExpertPlacement(
            _place(load.double().tolist(), len(self.slot_experts), self.num_ranks), self.num_experts, self.num_ranks
        )


def _place(load: list[float], num_slots: int, num_ranks: int) -> tuple[int, ...]:
    num_experts = len(load)
    replicas = [1] * num_experts
    heap = [(-load[e], e) for e in range(num_experts)]
    heapq.heapify(heap)
    for _ in range(num_slots - num_experts):
        _, expert = heapq.heappop(heap)
        replicas[expert] += 1
        heapq.heappush(heap, (-load[expert] / replicas[expert], expert))
    pieces = sorted(((load[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e])), reverse=True)
    per_rank = num_slots // num_ranks
    rank_load = [0.0] * num_ranks
    rank_experts: list[list[int]] = [[] for _ in range(num_ranks)]
    for weight, expert in pieces:
        open_ranks = [r for r in range(num_ranks) if len(rank_experts[r]) < per_rank]
        fresh = [r for r in open_ranks if expert not in rank_experts[r]] or open_ranks
        rank = min(fresh, key=lambda r: (rank_load[r], r))
        rank_experts[rank].append(expert)
        rank_load[rank] += weight
    return tuple(e for experts in rank_experts for e in sorted(experts))
