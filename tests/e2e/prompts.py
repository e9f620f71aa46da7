"""Prompts for the end-to-end tests: mixed lengths across block boundaries, shared prefixes."""

from __future__ import annotations

import random

from tests.utils.checkpoints import VOCAB


def shared_prefix_prompts(count: int = 32, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (40, 25, 0)]
    return [prefixes[i % 3] + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(3, 40))] for i in range(count)]
