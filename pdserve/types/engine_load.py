"""An engine's load: what it holds and the limits it runs under, taken after each step.

One struct goes from the engine loop into the worker's registry entry (JSON in etcd, read by
routers, the planner and the CLI) and into its Prometheus gauges. It imports nothing but
msgspec, so processes that never run a model can read it without loading torch.
"""

from __future__ import annotations

import msgspec


class EngineLoad(msgspec.Struct, kw_only=True, frozen=True):
    """A snapshot of an engine's occupancy; 0 for anything not reported."""

    running: int = 0  # requests holding blocks: running, or (decode) awaiting their prompt's KV
    awaiting_kv: int = 0  # of those, the ones awaiting their prompt's KV
    waiting: int = 0
    # Prefill: requests whose blocks stay pinned until a decode worker has pulled them.
    held_requests: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens not computed yet, over waiting and running requests
    num_preemptions: int = 0  # since start
    # The scheduler's limits in force (live knobs may lower them below the start-up values).
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use; 0 when the pool is not reported."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
