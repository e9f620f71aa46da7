"""Rank groups: the processes of one worker, and the collectives between them.

A group of ``world_size = data_parallel_size * tensor_parallel_size`` ranks, one process
each. Rank ``r`` is tensor-parallel rank ``r % tp`` of data-parallel rank ``r // tp``; with
expert parallelism every rank of the group holds a share of the experts. gloo on CPU, NCCL
on GPU: the same code either way.

- ``parallel_config``: ``ParallelConfig``, a group's shape (imports msgspec only);
- ``parallel_state``: ``ParallelState``, one rank's place in its group and its collectives;
- ``rank_group``: ``RankGroup``, ``start_group``: starting and watching a group's processes;
- ``channel``: the pipes between a group's leader and its ranks; ``errors``: ``RankFailed``.

The names below are imported on first use, so that the CLI's commands that take a
``ParallelConfig`` (and the operator, which loads the CLI) load no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.distributed.errors import RankFailed
    from pdserve.distributed.parallel_config import ParallelConfig
    from pdserve.distributed.parallel_state import SINGLE_RANK, ParallelState
    from pdserve.distributed.rank_group import RankGroup, start_group

__all__ = ["SINGLE_RANK", "ParallelConfig", "ParallelState", "RankFailed", "RankGroup", "start_group"]

_MODULE_OF = {
    "RankFailed": "errors",
    "ParallelConfig": "parallel_config",
    "SINGLE_RANK": "parallel_state",
    "ParallelState": "parallel_state",
    "RankGroup": "rank_group",
    "start_group": "rank_group",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
