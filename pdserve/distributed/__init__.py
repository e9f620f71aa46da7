"""Rank groups: the processes of one worker, and the collectives between them.

A group of ``world_size = data_parallel_size * tensor_parallel_size`` ranks, one process
each. Rank ``r`` is tensor-parallel rank ``r % tp`` of data-parallel rank ``r // tp``; with
expert parallelism every rank of the group holds a share of the experts. gloo on CPU, NCCL
on GPU: the same code either way.

- ``parallel_config``: a group's sizes and deadlines (``ParallelConfig``);
- ``parallel_state``: one rank's place in its group and the collectives (``ParallelState``);
- ``channel``: rank 0's ordered messages to the other ranks, over the group's store;
- ``errors``: ``RankFailed``, the one error a group raises when it can no longer work;
- ``rank_group``: starting a group's ranks together (``start_group``) and tearing them down;
- ``rank_program``: the skeleton of every child rank's program (``run_rank``).

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
