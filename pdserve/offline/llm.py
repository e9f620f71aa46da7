"""The offline API: ``LLM(model=PATH).generate(prompts, sampling_params)``.

``LLMEngine`` speaks token ids only; the text of a completion is made by ``Generation``, with
one ``IncrementalDetokenizer`` per request, and so are stop strings.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from pdserve.distributed.errors import RankFailed
from pdserve.distributed.parallel_config import ParallelConfig
from pdserve.distributed.parallel_state import SINGLE_RANK
from pdserve.distributed.rank_group import start_group
from pdserve.engine.engine import LLMEngine
from pdserve.offline.generation import (
    CompletionChunk,
    CompletionOutput,
    GenerateCommand,
    Generation,
    Prompt,
    as_prompt_list,
    generate_share,
)
from pdserve.offline.rank_main import rank_program
from pdserve.text.tokenizer import Tokenizer
from pdserve.types.engine_config import EngineConfig
from pdserve.types.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionChunk", "CompletionOutput"]


class LLM:
    """Runs a Hugging Face model directory offline with continuous batching.

    ``engine_args`` are ``EngineConfig`` fields (``kv_cache_memory``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``block_size``, ``enable_prefix_caching``, ``kernels``, ...).

    ``tensor_parallel_size`` and ``data_parallel_size`` (with ``enable_expert_parallel``) spread
    the model over a group of ranks, one process each: this process is rank 0 and starts the
    others; ``close()`` (or leaving a ``with`` block) stops them. ``num_redundant_experts`` and
    ``eplb_interval_steps`` turn on expert-parallel load balancing.
    """

    def __init__(
        self,
        model: str,
        dtype: str | None = None,
        *,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        num_redundant_experts: int = 0,
        eplb_interval_steps: int = 0,
        **engine_args: Any,
    ) -> None:
        config = EngineConfig(dtype=dtype, **engine_args)
        parallel_config = ParallelConfig(
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size,
            enable_expert_parallel=enable_expert_parallel,
            num_redundant_experts=num_redundant_experts,
            eplb_interval_steps=eplb_interval_steps,
        )
        self._group = start_group(
            parallel_config, "pdserve.offline.rank_main", rank_program(model, config), config.device
        )
        parallel = self._group.state if self._group else SINGLE_RANK
        assert parallel is not None  # a started group has joined
        try:
            self.engine = LLMEngine(model, config, parallel=parallel)
        except BaseException:
            self._close_group()
            raise
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the group's other ranks (nothing to do on a single rank). Safe to call twice."""
        if self._group is not None:
            self.engine.close()
            if self.engine.parallel.dp_size > 1:
                self.engine.parallel.commands.send(GenerateCommand(stop=True))
        self._close_group()

    def _close_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def rebalance_experts(self) -> None:
        """Re-place the experts of every expert-parallel MoE layer by the load counted so far,
        after the next model step (every rank of the group at the same step)."""
        if self.engine.parallel.ep_size == 1:
            raise ValueError("rebalance_experts needs enable_expert_parallel and more than one rank")
        self.engine.runner.rebalance_requested = True

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt; results come back in input order."""
        prompt_list = as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts")
        if self._group is not None and self._group.dead_ranks():
            raise RankFailed(f"ranks {self._group.dead_ranks()} of this LLM's group have exited; make a new LLM")
        parallel = self.engine.parallel
        if parallel.dp_size == 1:
            return Generation(self.engine, self._ids).run(prompt_list, params_list)
        # Data-parallel attention: every rank generates its share of the prompts, in lockstep.
        for index, (prompt, params) in enumerate(zip(prompt_list, params_list)):
            try:
                self.engine.check_request(prompt, params)
            except ValueError as error:
                raise ValueError(f"prompts[{index}]: {error}") from None
        parallel.commands.send(GenerateCommand(prompts=prompt_list, params=params_list))
        return generate_share(self.engine, GenerateCommand(prompts=prompt_list, params=params_list), self._ids)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[CompletionChunk]:
        """Generate for one prompt, a chunk per engine step; the last chunk has ``output``.

        Closing the iterator early aborts the request. Not with data-parallel ranks.
        """
        if self.engine.parallel.dp_size > 1:
            raise ValueError("stream() runs on one data-parallel rank; use generate() with data_parallel_size > 1")
        generation = Generation(self.engine, self._ids)
        request_id = generation.add(prompt, sampling_params or SamplingParams())
        try:
            while generation.running:
                for _, chunk in generation.step():
                    yield chunk
        finally:
            self.engine.abort(request_id)  # nothing left to free once it finished
