"""Generating completions on one engine: requests in, finished completions (text included) out.

A request whose text reaches a stop string is aborted in the engine and finishes with reason
``"stop"`` at the token that completed it. With data-parallel attention each rank runs its
share of the prompts in lockstep with the others (``generate_share``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import cast
from dataclasses import dataclass

import msgspec

from pdserve.engine.engine import LLMEngine
from pdserve.engine.output import RequestOutput
from pdserve.text.detokenizer import IncrementalDetokenizer
from pdserve.types.logprobs import Logprobs
from pdserve.types.sampling_params import SamplingParams

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


class Generation:
    """Requests added to ``engine`` and stepped until they finish."""

    def __init__(self, engine: LLMEngine, ids: itertools.count) -> None:
        self.engine = engine
        self.ids = ids
        self.running: dict[str, _Completion] = {}

    def run(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[CompletionOutput]:
        """Every prompt's completion, in order; on any error every request is aborted."""
        return self.run_until_done(prompts, params, lambda: bool(self.running))

    def run_until_done(
        self, prompts: list[Prompt], params: list[SamplingParams], more_steps: Callable[[], bool]
    ) -> list[CompletionOutput]:
        """Like ``run``, stepping while ``more_steps()`` says so."""
        request_ids = []
        try:
            for index, (prompt, p) in enumerate(zip(prompts, params)):
                try:
                    request_ids.append(self.add(prompt, p))
                except ValueError as error:
                    raise ValueError(f"prompts[{index}]: {error}") from None
            results = {}
            while more_steps():
                for request_id, chunk in self.step():
                    if chunk.output is not None:
                        results[request_id] = chunk.output
        except BaseException:
            for request_id in request_ids:
                self.engine.abort(request_id)
            raise
        return [results[request_id] for request_id in request_ids]

    def add(self, prompt: Prompt, params: SamplingParams) -> str:
        request_id = f"offline-{next(self.ids)}"
        request = self.engine.add_request(request_id, prompt, params)
        tokenizer = self.engine.tokenizer
        detokenizer = None
        if tokenizer is not None:
            detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.stop)
        self.running[request_id] = _Completion(detokenizer)
        return request_id

    def step(self) -> list[tuple[str, CompletionChunk]]:
        """One engine step: each running request's chunk; finished requests leave ``running``."""
        chunks = []
        for output in self.engine.step().outputs:
            completion = self.running.get(output.request_id)
            if completion is None:
                continue
            chunk = completion.take(output)
            if chunk.output is not None:
                del self.running[output.request_id]
                if not output.finished:  # a stop string ended it: free its blocks now
                    self.engine.abort(output.request_id)
            chunks.append((output.request_id, chunk))
        return chunks


class GenerateCommand(msgspec.Struct, frozen=True, kw_only=True):
    """Rank 0 to the other data-parallel ranks: generate for these prompts (or stop serving)."""

    prompts: list[str | list[int]] = []
    params: list[SamplingParams] = []
    stop: bool = False


class RankResults(msgspec.Struct, frozen=True):
    """One data-parallel rank's completions, with the prompt index of each."""

    indices: list[int]
    outputs: list[CompletionOutput]


def generate_share(engine: LLMEngine, command: GenerateCommand, ids: itertools.count) -> list[CompletionOutput]:
    """Generate this data-parallel rank's share of ``command`` (prompt i goes to rank i mod D).

    Every rank steps while any rank has requests, so that the expert-parallel exchanges inside
    each step always have all ranks; rank 0 returns every completion in prompt order (the others
    return an empty list). Rank 0 checks every prompt before it sends the command
    (``LLMEngine.check_request``), so no rank refuses its share.
    """
    parallel = engine.parallel
    mine = list(range(parallel.dp_rank, len(command.prompts), parallel.dp_size))
    generation = Generation(engine, ids)
    outputs = generation.run_until_done(
        [command.prompts[i] for i in mine],
        [command.params[i] for i in mine],
        lambda: parallel.max_over_group([int(bool(generation.running))])[0] > 0,
    )
    gathered = parallel.gather_to_driver(RankResults(mine, outputs), RankResults)
    if gathered is None:
        return []
    results: list[CompletionOutput] = [None] * len(command.prompts)  # type: ignore[list-item]
    for part in gathered:
        for index, output in zip(part.indices, part.outputs):
            results[index] = output
    return results


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(p, int) and not isinstance(p, bool) for p in items):
        return [cast(list[int], items)]  # one list of ints is one prompt
    return cast(list[Prompt], items)
