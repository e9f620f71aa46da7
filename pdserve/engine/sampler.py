"""Batched token sampling: penalties, temperature, top-k / top-p / min-p, logprobs.

Each row of the logits belongs to one request with its own SamplingParams. The order of
operations follows vLLM and HF transformers:

    repetition penalty (prompt + output) -> presence / frequency penalties (output)
    -> banned tokens (short of min_tokens) -> the grammar's mask (structured outputs,
    ``grammar_mask``) -> greedy rows: argmax
    -> other rows: temperature -> top-k -> top-p -> min-p -> sample

Returned logprobs are those of the raw model logits, before any of the above.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdserve.engine.grammar_mask import GrammarMask
from pdserve.types.logprobs import Logprobs
from pdserve.types.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher

# Temperatures below this are raised to it: dividing by a near-zero temperature overflows
# float32, and at 1e-5 any visible logit gap already makes the distribution one-hot.
_MIN_TEMPERATURE = 1e-5


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded with `seed` for one request, or None when the request is unseeded.

    The caller keeps it for the life of the request, so each step continues its stream.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingRequest:
    """One row of a sampling batch.

    `output_token_ids` are the tokens generated so far (read for the penalties);
    `generator` is the request's own generator (see make_generator), required when
    params.seed is set and None otherwise; `banned_token_ids` cannot be sampled (the tokens
    that would end a request short of its `min_tokens`); `matcher` is the request's grammar
    state when its output is structured (only the tokens it allows can be sampled).
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    banned_token_ids: list[int] = field(default_factory=list)
    matcher: LLMatcher | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None and self.generator is None:
            raise ValueError("a request with a seed needs a generator: pass make_generator(params.seed)")


@dataclass
class SamplerOutput:
    """One sampled token per row; logprobs[i] is None unless row i asked for them."""

    token_ids: list[int]
    logprobs: list[Logprobs | None]


class Sampler:
    """Picks the next token of every row of a batch; holds no state between calls.

    A seeded row draws its randomness only from its own generator, so it gets the same
    tokens whatever the other rows are and wherever it sits in the batch.
    """

    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """``argmax``: greedy rows' pick over float32 logits [R, V], as ``torch.argmax`` (a
        backend's faster one, ``Backend.argmax``); torch's by default."""
        self.argmax = argmax or (lambda logits: logits.argmax(dim=-1))
        self.grammar_mask = GrammarMask()

    def __call__(self, logits: torch.Tensor, requests: list[SamplingRequest]) -> SamplerOutput:
        """Sample from `logits` [num_rows, vocab] (any float dtype), row i for requests[i]."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [num_rows={len(requests)}, vocab], got {tuple(logits.shape)}")
        raw = logits.float()
        logits = raw
        if any(_has_penalties(r.params) for r in requests):
            logits = apply_penalties(logits, requests)
        if any(r.banned_token_ids for r in requests):
            logits = logits.clone() if logits is raw else logits  # the logprobs read the raw logits
            for row, request in enumerate(requests):
                if request.banned_token_ids:
                    logits[row, request.banned_token_ids] = -math.inf
        constrained = [(row, r.matcher) for row, r in enumerate(requests) if r.matcher is not None]
        if constrained:
            logits = logits.clone() if logits is raw else logits
            self.grammar_mask.apply(logits, constrained)

        sampled_rows = [i for i, r in enumerate(requests) if not r.params.is_greedy]
        if not sampled_rows:
            token_ids = self.argmax(logits)
        elif len(sampled_rows) == len(requests):
            token_ids = _sample(logits, requests)
        else:
            token_ids = self.argmax(logits)
            rows = torch.tensor(sampled_rows, device=logits.device)
            token_ids[rows] = _sample(logits[rows], [requests[i] for i in sampled_rows])

        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=_logprobs(raw, token_ids, requests))


def apply_penalties(logits: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
    """Return float32 `logits` [num_rows, vocab] with each row's penalties applied.

    Repetition penalty (HF): every token in the prompt or the output has a positive logit
    divided by the penalty and a negative one multiplied by it. Presence and frequency
    penalties (OpenAI): logit -= presence * (count > 0) + frequency * count, where count is
    how often the token appears in the output (the prompt does not count).
    """
    num_rows, vocab = logits.shape
    device = logits.device
    params = [r.params for r in requests]
    logits = logits.float()

    # Rows without penalties get no tokens, so their counts stay zero and they are untouched.
    output_counts = _token_counts(
        [r.output_token_ids if _has_penalties(r.params) else [] for r in requests], vocab, device
    )

    if any(p.repetition_penalty != 1.0 for p in params):
        in_prompt = (
            _token_counts(
                [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else [] for r in requests], vocab, device
            )
            > 0
        )
        seen = in_prompt | (output_counts > 0)
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)

    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        logits = logits - presence * (output_counts > 0) - frequency * output_counts
    return logits


def _has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each row's list, as float32 [num_rows, vocab]."""
    row_ids = [row for row, ids in enumerate(token_lists) for _ in ids]
    token_ids = [t for ids in token_lists for t in ids]
    counts = torch.zeros(len(token_lists), vocab, device=device)
    if token_ids:
        index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
        counts.index_put_(index, torch.ones(len(token_ids), device=device), accumulate=True)
    return counts


def _sample(logits: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
    """Sample one token id per row of the (penalised) float32 `logits` [num_rows, vocab]."""
    params = [r.params for r in requests]
    temperature = torch.tensor([max(p.temperature, _MIN_TEMPERATURE) for p in params], device=logits.device)
    logits = logits / temperature[:, None]
    logits = _apply_top_k_top_p(logits, params)
    logits = _apply_min_p(logits, params)
    return _exponential_race(logits.softmax(dim=-1), [r.generator for r in requests])


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set to -inf the logits top-k drops, then those top-p drops from what top-k kept."""
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    use_top_p = any(p.top_p < 1.0 for p in params)
    if not use_top_p and all(k == vocab for k in top_k):
        return logits

    # Stable, so ties fall in token-id order and a row's result ignores the rest of the batch.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.tensor(top_k, device=logits.device)
    drop = ranks[None, :] >= k[:, None]  # [num_rows, vocab], in sorted order
    if use_top_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # A token stays while the mass before it is short of top_p, so the top token always
        # stays. top_p == 1 becomes inf: rounding can push the cumulative sum past 1.0.
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=logits.device)
        drop |= mass_before >= top_p[:, None]
    drop = torch.empty_like(drop).scatter_(1, order, drop)  # back to token-id order
    return logits.masked_fill(drop, float("-inf"))


def _apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set to -inf the logits of tokens less likely than min_p times the most likely one."""
    if all(p.min_p == 0.0 for p in params):
        return logits
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=logits.device)[:, None]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def skip_draw(generator: torch.Generator, vocab_size: int) -> None:
    """Advance a seeded request's generator past one sampled token, as ``_exponential_race``
    would have: the token was sampled elsewhere (a prefill worker), and the rest of the
    request must draw what it would have drawn had it all run here (same seed, same tokens)."""
    torch.empty(vocab_size, device=generator.device).exponential_(generator=generator)


def _exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row of `probs` [num_rows, vocab].

    argmax(p / q) with q ~ Exp(1) picks token i with probability p_i (the smallest of
    independent exponentials with rates p_i), and needs only noise, which each seeded row
    draws from its own generator.
    """
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            own = torch.empty(probs.shape[-1], device=generator.device)
            noise[row] = own.exponential_(generator=generator).to(probs.device)
    # exponential_ can return 0, and 0 / 0 is NaN, which argmax would pick.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def _logprobs(raw: torch.Tensor, token_ids: torch.Tensor, requests: list[SamplingRequest]) -> list[Logprobs | None]:
    """Logprobs of the raw float32 logits [num_rows, vocab] for the rows that asked for them."""
    result: list[Logprobs | None] = [None] * len(requests)
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return result
    index = torch.tensor(rows, device=raw.device)
    logprobs = raw[index].log_softmax(dim=-1)  # [len(rows), vocab]
    chosen = logprobs.gather(1, token_ids[index][:, None]).squeeze(1).tolist()
    num_top = min(max(n for r in requests if (n := r.params.logprobs) is not None), raw.shape[-1])
    top_value_rows, top_id_rows = logprobs.topk(num_top, dim=-1)
    top_values, top_ids = top_value_rows.tolist(), top_id_rows.tolist()
    for j, i in enumerate(rows):
        n = requests[i].params.logprobs
        result[i] = Logprobs(token_logprob=chosen[j], top=list(zip(top_ids[j][:n], top_values[j][:n])))
    return result
