"""The one skeleton of every child rank's program (ranks 1..N-1 of a group).

Contract: ``run_rank`` sets up logging, joins the group (``child_start``; a rank started on
another host passes the group it already joined, ``joined``), decodes the msgspec
payload rank 0 handed ``start_group``, sets this process's torch CPU threads from it, and runs
``body(payload, parallel)``. It returns the process's exit status:

- ``body``'s own status when it returns (0: the group was stopped in order);
- 1 when ``body`` raises ``RankFailed``: another rank is gone, so this one only says it stops;
- 1 when anything else is raised, logged with its traceback.

Whatever happens, the rank leaves ``torch.distributed`` before it returns. ``body`` stops what
it started itself (threads, agents) before it returns or raises. A program's module ends with
``sys.exit(main())``, ``main`` returning ``run_rank(...)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

import msgspec
import torch
import torch.distributed as dist

from pdserve.distributed.errors import RankFailed
from pdserve.distributed.parallel_state import ParallelState
from pdserve.distributed.rank_group import RankStart, child_start

# A follower rank logs little, and names itself by its pid (its parent's log names the group).
RANK_LOG_FORMAT = "%(asctime)s rank %(process)d %(levelname)s %(message)s"


class RankPayload(Protocol):
    """A rank program's payload: a msgspec Struct that knows rank 0's torch CPU threads."""

    @property
    def num_threads(self) -> int | None: ...  # None: torch's default


P = TypeVar("P", bound=RankPayload)


def run_rank(
    payload_type: type[P],
    body: Callable[[P, ParallelState], int],
    *,
    logger: logging.Logger,
    log_level: int = logging.WARNING,
    log_format: str = RANK_LOG_FORMAT,
    joined: tuple[RankStart, ParallelState] | None = None,
) -> int:
    """Run this rank's ``body`` in its group; its exit status (see the module's contract)."""
    logging.basicConfig(level=log_level, format=log_format)
    start, parallel = child_start() if joined is None else joined
    try:
        payload = msgspec.msgpack.decode(start.payload, type=payload_type)
        if payload.num_threads is not None:
            torch.set_num_threads(payload.num_threads)
        return body(payload, parallel)
    except RankFailed as error:  # another rank is gone: nothing of this one's to report
        logger.warning("rank %d stops: %s", parallel.rank, error)
        return 1
    except Exception:
        logger.exception("rank %d failed", parallel.rank)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
