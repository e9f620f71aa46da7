"""The offline API: ``LLM(model=PATH).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.sampler import Logprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    """One prompt's result: the generated ids, their text, and why generation ended."""

    num_prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    logprobs: list[Logprobs | None]
    num_cached_tokens: int


class LLM:
    """Runs a Hugging Face model directory offline with continuous batching.

    ``engine_args`` are ``EngineConfig`` fields (``kv_cache_memory``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``block_size``, ``enable_prefix_caching``, ``kernels``, ...).
    """

    def __init__(self, model: str, dtype: str | None = None, **engine_args: object) -> None:
        self.engine = LLMEngine(model, EngineConfig(dtype=dtype, **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt; results come back in input order."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts"
                )
        request_ids = []
        try:
            for index, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                request_id = f"offline-{next(self._ids)}"
                try:
                    self.engine.add_request(request_id, prompt, params)
                except ValueError as error:
                    raise ValueError(f"prompts[{index}]: {error}") from None
                request_ids.append(request_id)
            results = {}
            while len(results) < len(request_ids):
                for output in self.engine.step().outputs:
                    if output.finished:
                        results[output.request_id] = CompletionOutput(
                            num_prompt_tokens=output.num_prompt_tokens,
                            token_ids=list(output.token_ids),
                            text=output.text,
                            finish_reason=output.finish_reason,
                            logprobs=list(output.logprobs),
                            num_cached_tokens=output.num_cached_tokens,
                        )
        except BaseException:
            for request_id in request_ids:
                self.engine.abort(request_id)
            raise
        return [results[request_id] for request_id in request_ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one list of ints is one prompt
    return prompts
