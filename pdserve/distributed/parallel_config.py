"""How a worker spreads over ranks: one struct, checked on construction."""

from __future__ import annotations

import msgspec

# How long ranks wait for each other to start (rendezvous) and inside one collective. A
# collective that outlives it means a rank is gone or stuck: the group fails rather than hangs.
RENDEZVOUS_TIMEOUT_S = 120.0
COLLECTIVE_TIMEOUT_S = 300.0


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The one place for the parallelism options and their defaults."""

    tensor_parallel_size: int = 1
    # Data-parallel attention: each DP rank runs attention for its own requests with its own
    # KV cache; it only means something with expert parallelism (the ranks share the experts).
    # With both above 1, each DP rank is a tensor-parallel group of its own.
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # Expert-parallel load balancing: extra expert replicas per MoE layer, and how many engine
    # steps pass between rebalances (0: only on demand).
    num_redundant_experts: int = 0
    eplb_interval_steps: int = 0
    rendezvous_timeout_s: float = RENDEZVOUS_TIMEOUT_S
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.data_parallel_size > 1 and not self.enable_expert_parallel:
            raise ValueError(
                "data_parallel_size > 1 is data-parallel attention for expert-parallel MoE models: "
                "set enable_expert_parallel (for a dense model, run one worker per replica instead)"
            )
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if (self.num_redundant_experts or self.eplb_interval_steps) and not self.enable_expert_parallel:
            raise ValueError("num_redundant_experts and eplb_interval_steps need enable_expert_parallel")
        if self.eplb_interval_steps < 0:
            raise ValueError(f"eplb_interval_steps must be >= 0, got {self.eplb_interval_steps}")
        if self.rendezvous_timeout_s <= 0 or self.collective_timeout_s <= 0:
            raise ValueError("rendezvous_timeout_s and collective_timeout_s must be > 0")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def ep_size(self) -> int:
        """Ranks the experts are spread over: the whole group, or 1 without expert parallelism."""
        return self.world_size if self.enable_expert_parallel else 1
