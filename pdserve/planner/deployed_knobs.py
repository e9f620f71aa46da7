"""The knobs in force for a model when none are stored in etcd."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve.discovery.knobs import Knobs
from pdserve.discovery.registry import Role, WorkerEntry
from pdserve.observability.frontend_stats import FrontendStats


def deployed_knobs(model: str, workers: Sequence[WorkerEntry], frontends: Sequence[FrontendStats]) -> Knobs:
    """The knobs in force for ``model`` when none are stored: its workers' start-up budgets
    (the tightest of each pool) and its frontends' local-prefill threshold (0 when none
    routes conditionally); ``Knobs()``'s defaults for whatever no live component reports."""
    default = Knobs()

    def tightest(role: str, limit: Callable[[WorkerEntry], int], fallback: int) -> int:
        return min((limit(w) for w in workers if w.model == model and w.role == role and limit(w)), default=fallback)

    seqs = tightest(Role.DECODE, lambda w: w.max_num_seqs, default.decode_max_num_seqs)
    tokens = tightest(Role.DECODE, lambda w: w.max_num_batched_tokens, default.decode_max_num_batched_tokens)
    thresholds = [f.local_prefill_tokens for f in frontends if f.local_prefill_tokens is not None]
    if not thresholds and frontends:  # none routes conditionally: no prompt is prefilled locally
        thresholds = [0]
    return Knobs(
        decode_max_num_seqs=seqs,
        decode_max_num_batched_tokens=max(seqs, tokens),
        prefill_chunk_size=tightest(Role.PREFILL, lambda w: w.max_num_batched_tokens, default.prefill_chunk_size),
        local_prefill_threshold_tokens=min(thresholds, default=default.local_prefill_threshold_tokens),
    )
