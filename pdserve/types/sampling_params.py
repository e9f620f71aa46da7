"""Per-request sampling parameters, with vLLM / OpenAI semantics."""

from __future__ import annotations

import math

import msgspec

from pdserve.types.structured_output import StructuredOutput

# OpenAI caps the number of returned top logprobs at 20.
MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick the tokens of one request; checked once, at construction.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: divides the logits before sampling; 0 means greedy (argmax).
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose
            probability sums to at least top_p, in (0, 1]; 1 disables it.
        top_k: keep only the k most likely tokens; -1 (or 0) disables it.
        min_p: drop tokens whose probability is below min_p times that of the most
            likely token, in [0, 1]; 0 disables it.
        seed: seeds this request's own random generator, so its tokens do not depend
            on what else is in the batch; None draws from the global generator.
        stop: strings that end generation when produced (not included in the output).
        stop_token_ids: token ids that end generation when sampled.
        ignore_eos: keep generating past the end-of-sequence token.
        min_tokens: the end-of-sequence token and ``stop_token_ids`` cannot be sampled before
            this many tokens were generated, in [0, max_tokens] (stop strings still apply).
        logprobs: return the logprob of the sampled token and of the top-n tokens,
            n in [0, 20]; None returns none.
        repetition_penalty: HF-style penalty on every token seen in the prompt or the
            output (positive logits divided by it, negative ones multiplied); > 0, 1
            disables it.
        presence_penalty: OpenAI-style: subtracted once from the logit of every token
            already generated, in [-2, 2].
        frequency_penalty: OpenAI-style: subtracted from a token's logit once per time
            it was already generated, in [-2, 2].
        structured: the output must match this JSON schema, regex, choice or grammar: tokens
            that would break it cannot be sampled, and the request stops (reason ``"stop"``)
            when the grammar can go no further; None leaves the output free.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an int >= 1", self.max_tokens)
        _require(
            _is_real(self.temperature) and self.temperature >= 0,
            "temperature",
            ">= 0 (0 means greedy)",
            self.temperature,
        )
        _require(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(_is_int(self.top_k) and self.top_k >= -1, "top_k", "-1 or 0 (disabled) or an int >= 1", self.top_k)
        _require(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        # torch.Generator.manual_seed takes at most 64 bits.
        _require(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**64),
            "seed",
            "None or an int in [0, 2**64)",
            self.seed,
        )
        if isinstance(self.stop, str):
            # A frozen struct cannot normalise the value, so ask for the list instead.
            raise ValueError(f"stop must be a list of strings, got the bare string {self.stop!r}; pass [{self.stop!r}]")
        _require(
            self.stop is None or (isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop)),
            "stop",
            "None or a list of non-empty strings",
            self.stop,
        )
        _require(
            self.stop_token_ids is None
            or (isinstance(self.stop_token_ids, list) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids)),
            "stop_token_ids",
            "None or a list of ints >= 0",
            self.stop_token_ids,
        )
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool", self.ignore_eos)
        _require(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"an int in [0, max_tokens = {self.max_tokens}]",
            self.min_tokens,
        )
        _require(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"None or an int in [0, {MAX_LOGPROBS}]",
            self.logprobs,
        )
        _require(
            _is_real(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "> 0 (1 disables it)",
            self.repetition_penalty,
        )
        _require(
            _is_real(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            "in [-2, 2]",
            self.presence_penalty,
        )
        _require(
            _is_real(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "in [-2, 2]",
            self.frequency_penalty,
        )
        _require(
            self.structured is None or isinstance(self.structured, StructuredOutput),
            "structured",
            "None or a StructuredOutput",
            self.structured,
        )

    @property
    def is_greedy(self) -> bool:
        """True when the most likely token is always taken (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1


def _require(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but True where a count is expected is a caller bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """An int or a float that is finite (NaN and inf compare false or break the maths)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
