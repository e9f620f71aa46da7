"""A request as the engine tracks it, from arrival to finish."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdserve.types.logprobs import Logprobs
from pdserve.types.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)computation
    WAITING_FOR_KV = "waiting_for_kv"  # blocks allocated; the prompt's KV comes from elsewhere
    RUNNING = "running"
    FINISHED = "finished"


class KVRole(enum.Enum):
    """How a request's KV relates to other workers (the seams for disaggregation)."""

    LOCAL = "local"  # compute everything here, free on finish
    PRODUCER = "producer"  # prefill role: stop after the first token, hold the blocks for a peer
    CONSUMER = "consumer"  # decode role: the prompt's KV is written into our blocks from elsewhere


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None = None
    kv_role: KVRole = KVRole.LOCAL
    pin_s: float | None = None  # PRODUCER: how long its blocks stay pinned for the peer, at most
    cache_salt: str | None = None  # shares prefix-cache blocks only with requests of the same salt
    # The grammar state of a structured output (``params.structured``): it takes every output
    # token, however the request got it (sampled here, resumed with, or a peer's first token).
    matcher: LLMatcher | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    # All tokens so far (prompt, then outputs); tokens [0, num_computed_tokens) have KV.
    token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprobs | None] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    first_scheduled_time: float | None = None  # first computed, or (consumer) first given blocks
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def awaits_kv(self) -> bool:
        """A CONSUMER whose KV (prompt, and any tokens it resumed with) is still to come from a
        peer; once it has run, a preemption makes it recompute here like any other."""
        return self.kv_role is KVRole.CONSUMER and self.num_preemptions == 0

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def resume(self, generated_token_ids: list[int]) -> None:
        """Take the output tokens generated for this request elsewhere (before any of its own).

        Raises ValueError when they break the request's grammar (they were not generated under it).
        """
        assert not self.output_token_ids, "a request resumes before it generates"
        if self.matcher is not None and generated_token_ids and not self.matcher.consume_tokens(generated_token_ids):
            raise ValueError(f"generated_token_ids break the request's structured output: {self.matcher.get_error()}")
        self.token_ids.extend(generated_token_ids)
        self.output_token_ids.extend(generated_token_ids)
        self.output_logprobs.extend([None] * len(generated_token_ids))

    def append_output(self, token_id: int, logprobs: Logprobs | None) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprobs)
        if self.matcher is not None:
            self.matcher.consume_token(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
