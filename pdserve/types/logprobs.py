"""A sampled token's logprobs, as the engine reports them and the wire carries them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprobs:
    """Logprobs of one row: the sampled token's, and the top-n (token_id, logprob), best first."""

    token_logprob: float
    top: list[tuple[int, float]]
