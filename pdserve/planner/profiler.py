"""Measure an engine's prefill and decode speed into an ``EngineProfile``.

Times ``LLMEngine.step()`` itself, so the profile carries everything a step costs on that
replica (scheduling, input preparation, the model, sampling), as a worker would see it.
Prompts are random token ids, fresh for every measurement so that the prefix cache never
turns a measurement into a cache hit. Each point keeps the fastest of its repeats: other
load on the machine only ever adds time, so the minimum is the engine's own cost.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.engine import LLMEngine
from pdserve.planner.profile import DecodeGrid, EngineProfile, PrefillPoint
from pdserve.types.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProfilePlan:
    """What to measure: prefill at each prompt length, decode at every batch size by context
    length (a grid). Every point must fit the engine (context window, KV cache, batch cap)."""

    prompt_lengths: Sequence[int] = (32, 128, 512, 1024)
    batch_sizes: Sequence[int] = (1, 8, 32)
    context_lengths: Sequence[int] = (64, 512)  # per request, in the decode measurements
    decode_steps: int = 8  # timed decode steps per (batch, context) shape; the fastest is kept
    repeats: int = 2  # rounds over every point; each point keeps its fastest


def profile_engine(
    engine: LLMEngine, plan: ProfilePlan = ProfilePlan(), *, source: str = "", seed: int = 0
) -> EngineProfile:
    """Measure ``engine`` and return its profile; the engine is idle again afterwards."""
    rng = random.Random(seed)
    prompts = _PromptMaker(engine, rng)
    _check_plan(engine, plan)
    _run_to_end(engine, [prompts.make(min(16, engine.max_model_len - 2))], max_tokens=2)  # warm-up
    lengths = sorted(set(plan.prompt_lengths))
    batches, contexts = sorted(set(plan.batch_sizes)), sorted(set(plan.context_lengths))
    prefill = [math.inf] * len(lengths)
    decode = [[math.inf] * len(contexts) for _ in batches]
    # Whole rounds rather than back-to-back repeats: a burst of other load then spoils one
    # round of a point, not all of its measurements.
    for _ in range(plan.repeats):
        for i, n in enumerate(lengths):
            prefill[i] = min(prefill[i], _run_to_end(engine, [prompts.make(n)], max_tokens=1))
        for i, batch in enumerate(batches):
            for j, context in enumerate(contexts):
                decode[i][j] = min(decode[i][j], _measure_decode(engine, prompts, batch, context, plan.decode_steps))
    prefill, decode = monotone(prefill), monotone_grid(decode)
    # The grid's context axis is per sequence, halfway through the timed steps.
    context_per_seq = [context + 1 + plan.decode_steps // 2 for context in contexts]

    mc = engine.model_config
    return EngineProfile(
        name=f"{mc.architecture} hidden {mc.hidden_size} x {mc.num_layers} layers, {str(mc.dtype).removeprefix('torch.')}, "
        f"{engine.device.type}, {engine.backend.name} kernels",
        source=source or "pdserve.planner.profiler.profile_engine",
        prefill=[PrefillPoint(n, seconds) for n, seconds in zip(lengths, prefill)],
        decode=DecodeGrid(batches=batches, context_per_seq=context_per_seq, seconds=decode),
        kv_capacity_tokens=engine.block_pool.num_blocks * engine.config.block_size,
        kv_bytes_per_token=engine.kv_cache_spec.bytes_per_token,
        max_num_seqs=engine.scheduler.config.max_num_seqs,
    )


def monotone(values: list[float]) -> list[float]:
    """Each value raised to the largest before it: more work never takes less time, so a
    dip is noise that outlasted the repeats (on a shared CPU, memory-bound steps can be)."""
    out, highest = [], 0.0
    for value in values:
        highest = max(highest, value)
        out.append(highest)
    return out


def monotone_grid(grid: list[list[float]]) -> list[list[float]]:
    """``monotone`` along both axes of a grid (rows: batch, columns: context)."""
    rows = [monotone(row) for row in grid]
    columns = [monotone(list(column)) for column in zip(*rows)]
    return [list(row) for row in zip(*columns)]


def _check_plan(engine: LLMEngine, plan: ProfilePlan) -> None:
    """Raise ValueError naming the first measurement the engine cannot hold."""
    max_len, block_size = engine.max_model_len, engine.config.block_size
    num_blocks, max_num_seqs = engine.block_pool.num_blocks, engine.scheduler.config.max_num_seqs
    for n in plan.prompt_lengths:
        if n < 1 or n + 1 >= max_len:
            raise ValueError(f"prompt length {n} does not fit the context window (max_model_len {max_len})")
    for batch in plan.batch_sizes:
        if not 1 <= batch <= max_num_seqs:
            raise ValueError(f"decode batch {batch} is outside [1, max_num_seqs={max_num_seqs}]")
        for context in plan.context_lengths:
            per_seq = context + _decode_max_tokens(engine, batch, context, plan.decode_steps)
            if context < 1 or per_seq >= max_len or batch * -(-per_seq // block_size) > num_blocks:
                raise ValueError(
                    f"decode batch {batch} x context {context} does not fit (max_model_len {max_len}, "
                    f"{num_blocks} KV blocks of {block_size})"
                )


class _PromptMaker:
    def __init__(self, engine: LLMEngine, rng: random.Random) -> None:
        self._engine = engine
        self._rng = rng
        self._count = 0
        # Skip the low ids, where checkpoints usually keep their special tokens.
        self._low = min(3, engine.model_config.vocab_size - 1)

    def make(self, length: int) -> tuple[str, list[int]]:
        self._count += 1
        vocab = self._engine.model_config.vocab_size
        return f"profile-{self._count}", [self._rng.randrange(self._low, vocab) for _ in range(length)]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _run_to_end(engine: LLMEngine, prompts: list[tuple[str, list[int]]], max_tokens: int) -> float:
    """Seconds of engine steps from adding ``prompts`` until all have finished."""
    for request_id, token_ids in prompts:
        engine.add_request(request_id, token_ids, _params(max_tokens))
    elapsed = 0.0
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        elapsed += time.perf_counter() - start
    return elapsed


def _measure_decode(engine: LLMEngine, prompts: _PromptMaker, batch: int, context: int, steps: int) -> float:
    """Seconds of the fastest pure decode step with ``batch`` requests of ``context`` prompt tokens."""
    generated: dict[str, int] = {}
    for _ in range(batch):
        request_id, token_ids = prompts.make(context)
        engine.add_request(request_id, token_ids, _params(_decode_max_tokens(engine, batch, context, steps)))
        generated[request_id] = 0
    # Prefill (possibly chunked, with early decodes mixed in) until every request has its
    # first token: from then on each step decodes exactly one token for each of them.
    while not all(generated.values()):
        for output in engine.step().outputs:
            generated[output.request_id] = len(output.token_ids)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for request_id in generated:
        engine.abort(request_id)
    return min(times)


def _decode_max_tokens(engine: LLMEngine, batch: int, context: int, steps: int) -> int:
    """Enough tokens that no request finishes before the timed steps end: the first requests
    decode while the last prompts are still being prefilled, one step per chunk."""
    prefill_steps = -(-batch * context // engine.scheduler.config.max_num_batched_tokens)
    return prefill_steps + steps + 2
