"""A child rank program on ``run_rank`` that does what its payload says
(``python -m tests.distributed.probe_rank``, started by ``start_group``).

``return``: tells rank 0 its torch CPU threads (an all-reduce), then exits with ``PROBE_STATUS``;
``rank_failed``: raises ``RankFailed``, as a rank whose group is gone does; ``raise``: raises
something else, as a broken rank does.
"""

from __future__ import annotations

import logging
import sys

import msgspec
import torch
import torch.distributed as dist

from pdserve.distributed.errors import RankFailed
from pdserve.distributed.parallel_state import ParallelState
from pdserve.distributed.rank_program import run_rank

PROBE_STATUS = 7

logger = logging.getLogger("tests.distributed.probe_rank")


class Probe(msgspec.Struct, frozen=True):
    outcome: str  # return, rank_failed or raise
    num_threads: int | None = None


def _run(probe: Probe, parallel: ParallelState) -> int:
    if probe.outcome == "rank_failed":
        raise RankFailed("rank 0 is gone (probe)")
    if probe.outcome == "raise":
        raise ValueError("probe breaks")
    threads = torch.tensor([torch.get_num_threads()])
    dist.all_reduce(threads)
    return PROBE_STATUS


if __name__ == "__main__":
    sys.exit(run_rank(Probe, _run, logger=logger))
