"""The program of ranks 1..N-1 of an offline ``LLM``'s group (``python -m pdserve.offline.rank_main``).

Rank 0 (the ``LLM``) starts them with ``distributed.start_group``. A data-parallel rank's leader
runs an engine of its own and generates its share of each offline ``generate`` call; any other
tensor-parallel rank loads its share of the model and runs every step its leader plans.
"""

from __future__ import annotations

import itertools
import logging
import sys

import msgspec
import torch

from pdserve.distributed.parallel_state import ParallelState
from pdserve.distributed.rank_program import run_rank
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.step_plan import GroupStart
from pdserve.model.kv_cache import KVCache
from pdserve.model.setup import setup_model
from pdserve.offline.generation import GenerateCommand, generate_share
from pdserve.types.engine_config import EngineConfig

logger = logging.getLogger("pdserve.offline.rank")


class RankProgram(msgspec.Struct, frozen=True, kw_only=True):
    """What every rank of the group runs: the model and the engine's options."""

    model: str
    engine: EngineConfig
    num_threads: int  # torch CPU threads, as rank 0 has them


def rank_program(model: str, engine: EngineConfig) -> bytes:
    """The payload ``start_group`` hands ranks 1..N-1 of an ``LLM``'s group."""
    return msgspec.msgpack.encode(RankProgram(model=model, engine=engine, num_threads=torch.get_num_threads()))


def main() -> int:
    return run_rank(RankProgram, _run, logger=logger)


def _run(program: RankProgram, parallel: ParallelState) -> int:
    if parallel.is_tp_leader:  # a data-parallel rank's leader (rank 0 is the LLM itself)
        engine = LLMEngine(program.model, program.engine, parallel=parallel)
        ids = itertools.count()
        while not (command := parallel.commands.receive(GenerateCommand)).stop:
            generate_share(engine, command, ids)
        engine.close()
    else:
        setup = setup_model(program.model, program.engine, parallel)
        num_blocks = parallel.plans.receive(GroupStart).num_blocks
        kv_cache = KVCache(setup.kv_spec, num_blocks, setup.device)
        ModelRunner(setup.model, kv_cache, None, setup.device, parallel).follow()
    return 0


if __name__ == "__main__":
    sys.exit(main())
