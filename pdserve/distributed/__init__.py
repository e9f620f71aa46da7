"""Rank groups: the processes of one worker, and the collectives between them.

A group of ``world_size = data_parallel_size * tensor_parallel_size`` ranks, one process
each. Rank ``r`` is tensor-parallel rank ``r % tp`` of data-parallel rank ``r // tp``; with
expert parallelism every rank of the group holds a share of the experts. gloo on CPU, NCCL
on GPU: the same code either way.

- ``parallel_config``: ``ParallelConfig``, how a worker spreads over ranks (msgspec only);
- ``errors``: ``RankFailed``, the one error a finished group raises (standard library only);
- ``parallel_state``: ``ParallelState`` and ``SINGLE_RANK``, one rank's place and its collectives (torch);
- ``rank_group``: ``RankGroup`` and ``start_group``, starting and tearing down a group (torch);
- ``channel``: ``Channel``, rank 0's ordered messages to its group over the group's store (torch).

Import the module that holds a name: the first two are light enough for the CLI and the
operator, which load no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.distributed.parallel_state import SINGLE_RANK as SINGLE_RANK
    from pdserve.distributed.parallel_state import ParallelState as ParallelState
    from pdserve.distributed.rank_group import RankGroup as RankGroup
    from pdserve.distributed.rank_group import start_group as start_group


def __getattr__(name: str) -> Any:
    # worker/group.py still imports these from the package; resolved on use, so that importing
    # the package (or its light modules) loads no torch.
    if name in ("SINGLE_RANK", "ParallelState"):
        from pdserve.distributed import parallel_state

        return getattr(parallel_state, name)
    if name in ("RankGroup", "start_group"):
        from pdserve.distributed import rank_group

        return getattr(rank_group, name)
    raise AttributeError(f"module 'pdserve.distributed' has no attribute {name!r}")
