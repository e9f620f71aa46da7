"""The program of ranks 1..N-1 of an engine's group (``python -m pdserve.engine.rank_main``).

Rank 0 (an ``LLM`` or a worker) starts them with ``start_group``. A tensor-parallel rank loads
its share of the model and runs every step rank 0 plans; a data-parallel rank runs an engine of
its own and generates its share of each offline ``generate`` call.
"""

from __future__ import annotations

import itertools
import logging
import sys

import msgspec
import torch
import torch.distributed as dist

from pdserve.distributed import ParallelConfig, RankFailed, RankGroup
from pdserve.distributed.rank_group import child_start
from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.generation import GenerateCommand, generate_share
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.model_setup import setup_model
from pdserve.engine.step_plan import GroupStart

logger = logging.getLogger("pdserve.engine.rank")


class RankProgram(msgspec.Struct, frozen=True, kw_only=True):
    """What every rank of the group runs: the model and the engine's options."""

    model: str
    engine: EngineConfig
    num_threads: int  # torch CPU threads, as rank 0 has them


def start_group(
    model: str, engine: EngineConfig, parallel: ParallelConfig, *, entry_module: str = "pdserve.engine.rank_main",
    payload: bytes | None = None,
) -> RankGroup | None:  # fmt: skip
    """Start ranks 1..N-1 for ``model`` and join the group as rank 0 (None for a single rank).

    ``entry_module`` and ``payload``: another program for ranks 1..N-1 (a serving worker's,
    which also runs a NIXL agent) and what it reads; by default this module's, with a
    ``RankProgram``.
    """
    if parallel.world_size == 1:
        return None
    device = "cuda" if engine.device == "cuda" or (engine.device == "auto" and torch.cuda.is_available()) else "cpu"
    if payload is None:
        payload = msgspec.msgpack.encode(RankProgram(model=model, engine=engine, num_threads=torch.get_num_threads()))
    group = RankGroup(parallel, entry_module, payload, device=device)
    group.start()
    return group


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s rank %(process)d %(levelname)s %(message)s")
    start, parallel = child_start()
    program = msgspec.msgpack.decode(start.payload, type=RankProgram)
    torch.set_num_threads(program.num_threads)
    try:
        if parallel.dp_size > 1:
            engine = LLMEngine(program.model, program.engine, parallel=parallel)
            ids = itertools.count()
            while not (command := parallel.channel.receive(GenerateCommand)).stop:
                generate_share(engine, command, ids)
        else:
            setup = setup_model(program.model, program.engine, parallel)
            num_blocks = parallel.channel.receive(GroupStart).num_blocks
            kv_cache = KVCache(setup.kv_spec, num_blocks, setup.device)
            ModelRunner(setup.model, kv_cache, None, setup.device, parallel).follow()
    except RankFailed as error:  # another rank is gone: nothing of this one's to report
        logger.warning("rank %d stops: %s", parallel.rank, error)
        return 1
    except Exception:
        logger.exception("rank %d failed", parallel.rank)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
