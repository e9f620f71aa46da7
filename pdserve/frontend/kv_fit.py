"""Whether a prefill worker's KV can move to a decode worker at all, told before routing.

Each rank of a worker group holds ``H / tp_size`` of the model's ``H`` KV heads, and a decode
rank reads its heads from the prefill ranks that hold them (``kvtransfer.tp``), so ``H`` must
divide over both groups' sizes. A group with more ranks than KV heads replicates them, which the
transfer does not support; that case fails the same test. MLA (``num_kv_heads`` 0) holds its
latent whole on every rank and fits any sizes (0 is also what a worker that does not say
publishes: it is let through). The workers check the full layout again before
any transfer; this check only keeps a pairing that can never work from being tried.
"""

from __future__ import annotations

from pdserve.discovery.registry import WorkerEntry


class KVMisfit(RuntimeError):
    """No prefill worker's KV heads can move to the chosen decode worker."""


def kv_misfit(prefill: WorkerEntry, decode: WorkerEntry) -> str | None:
    """Why ``prefill``'s KV cannot move to ``decode``, naming the sizes; None when it can."""
    if prefill.num_kv_heads and decode.num_kv_heads and prefill.num_kv_heads != decode.num_kv_heads:
        return (
            f"prefill worker {prefill.worker_id} has {prefill.num_kv_heads} KV heads, decode worker "
            f"{decode.worker_id} {decode.num_kv_heads}"
        )
    heads = prefill.num_kv_heads or decode.num_kv_heads
    for worker in (prefill, decode):
        if heads and heads % worker.tensor_parallel_size:
            return (
                f"the model's {heads} KV heads do not divide over {worker.role} worker {worker.worker_id}'s "
                f"tensor-parallel size {worker.tensor_parallel_size} (prefill tensor-parallel size "
                f"{prefill.tensor_parallel_size}, decode {decode.tensor_parallel_size})"
            )
    return None
