"""What a step reports for each request, and the token-level rules that end one.

A request ends at a token in its stop token ids, at EOS unless it ignores EOS, when its grammar
(a structured output) can take no further token (``"stop"``), or
at ``max_tokens`` or the context window (``"length"``); before ``min_tokens`` those tokens are
banned from sampling instead. Stop strings are text, and not the engine's (``engine``'s
docstring). Imports nothing from the engine but ``request``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request import Request
from pdserve.types.logprobs import Logprobs


@dataclass
class RequestOutput:
    """What one step produced for one request (cumulative fields included)."""

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]  # all generated tokens so far
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "kv_transfer"
    logprobs: list[Logprobs | None] = field(default_factory=list)  # one per generated token
    new_logprobs: list[Logprobs | None] = field(default_factory=list)  # one per new token
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Producer role, on the finishing output: the prompt's blocks, pinned for the peer.
    held_block_ids: list[int] | None = None
    # time.monotonic() stamps: arrival, first scheduled (consumer: given blocks), first token.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None


@dataclass
class StepOutput:
    outputs: list[RequestOutput]
    awaiting_kv: list[tuple[str, list[int], int]]  # (request id, block ids, cached tokens)
    num_scheduled_tokens: int = 0  # 0: the step ran no model (nothing was runnable)
    # Data-parallel ranks: whether any rank of the group ran the model in this step.
    group_ran_model: bool = False


def request_output(request: Request, new: list[int]) -> RequestOutput:
    """``request``'s output now, ``new`` being the tokens this step added (its last ones)."""
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new,
        token_ids=request.output_token_ids,
        finished=request.is_finished,
        finish_reason=request.finish_reason,
        logprobs=request.output_logprobs,
        # A copy taken now: the cumulative lists grow on the engine thread while a server reads this.
        new_logprobs=request.output_logprobs[len(request.output_logprobs) - len(new) :] if new else [],
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
    )


def stop_reason(request: Request, token: int, max_model_len: int) -> str | None:
    """Why ``token`` (just appended) ends the request, if it does."""
    params = request.params
    if request.matcher is not None and request.matcher.is_stopped():
        return "stop"
    if token in (params.stop_token_ids or ()) or (not params.ignore_eos and token in request.eos_token_ids):
        return "stop"
    if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= max_model_len:
        return "length"
    return None


def banned_token_ids(request: Request) -> list[int]:
    """The tokens that would end ``request`` before its ``min_tokens``: none once it has them."""
    params = request.params
    if len(request.output_token_ids) >= params.min_tokens:
        return []
    eos = () if params.ignore_eos else request.eos_token_ids
    return sorted({*(params.stop_token_ids or ()), *eos})
