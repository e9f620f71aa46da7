"""The offline API: ``LLM(model=PATH).generate(prompts, sampling_params)``.

``LLMEngine`` speaks token ids only; the text of a completion is made here, with one
``IncrementalDetokenizer`` per request, and so are stop strings: a request whose text reaches
one is aborted in the engine and finishes with reason ``"stop"`` at the token that completed it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.engine import LLMEngine, RequestOutput
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


@dataclass
class CompletionChunk:
    """What one engine step added to a streamed completion; the last chunk carries ``output``."""

    token_ids: list[int]
    text: str  # never a broken UTF-8 sequence, never text a stop string cuts
    output: CompletionOutput | None = None


class _Completion:
    """One request's output as the caller sees it: text, stop strings, the tokens up to a stop."""

    def __init__(self, detokenizer: IncrementalDetokenizer | None) -> None:
        self.detokenizer = detokenizer

    def take(self, output: RequestOutput) -> CompletionChunk:
        """The chunk for ``output``; the last one (``output`` set) when the request ends here."""
        new, text, stopped = output.new_token_ids, "", False
        if self.detokenizer is not None:
            num_taken, text = self.detokenizer.add_until_stop(new)
            new, stopped = new[:num_taken], self.detokenizer.stopped
            if output.finished and not stopped:
                text += self.detokenizer.flush()
        if not (output.finished or stopped):
            return CompletionChunk(new, text)
        num_tokens = len(output.token_ids) - len(output.new_token_ids) + len(new)
        final = CompletionOutput(
            num_prompt_tokens=output.num_prompt_tokens,
            token_ids=list(output.token_ids[:num_tokens]),
            text=self.detokenizer.text if self.detokenizer is not None else "",
            finish_reason="stop" if stopped else output.finish_reason or "abort",
            logprobs=list(output.logprobs[:num_tokens]),
            num_cached_tokens=output.num_cached_tokens,
        )
        return CompletionChunk(new, text, final)


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
        running: dict[str, _Completion] = {}
        request_ids = []
        try:
            for index, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                try:
                    request_ids.append(self._add(running, prompt, params))
                except ValueError as error:
                    raise ValueError(f"prompts[{index}]: {error}") from None
            results = {}
            while running:
                for request_id, chunk in self._step(running):
                    if chunk.output is not None:
                        results[request_id] = chunk.output
        except BaseException:
            for request_id in request_ids:
                self.engine.abort(request_id)
            raise
        return [results[request_id] for request_id in request_ids]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[CompletionChunk]:
        """Generate for one prompt, a chunk per engine step; the last chunk has ``output``.

        Closing the iterator early aborts the request.
        """
        running: dict[str, _Completion] = {}
        request_id = self._add(running, prompt, sampling_params or SamplingParams())
        try:
            while running:
                for _, chunk in self._step(running):
                    yield chunk
        finally:
            self.engine.abort(request_id)  # nothing left to free once it finished

    def _add(self, running: dict[str, _Completion], prompt: Prompt, params: SamplingParams) -> str:
        request_id = f"offline-{next(self._ids)}"
        request = self.engine.add_request(request_id, prompt, params)
        tokenizer = self.engine.tokenizer
        detokenizer = None
        if tokenizer is not None:
            detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.stop)
        running[request_id] = _Completion(detokenizer)
        return request_id

    def _step(self, running: dict[str, _Completion]) -> list[tuple[str, CompletionChunk]]:
        """One engine step: each running request's chunk; finished requests leave ``running``."""
        chunks = []
        for output in self.engine.step().outputs:
            completion = running.get(output.request_id)
            if completion is None:
                continue
            chunk = completion.take(output)
            if chunk.output is not None:
                del running[output.request_id]
                if not output.finished:  # a stop string ended it: free its blocks now
                    self.engine.abort(output.request_id)
            chunks.append((output.request_id, chunk))
        return chunks


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one list of ints is one prompt
    return prompts
