"""Stop strings that straddle the first generated token: the case the prefill-to-decode hand-off must get right."""

from __future__ import annotations

import torch

from pdserve import LLM, SamplingParams
from tests.utils.checkpoints import VOCAB


def stop_after_the_first_token(llm: LLM, completes: bool) -> tuple[list[int], str]:
    """A prompt and a stop string that begins with the last character of the prompt's first
    generated token (greedy): a later token completes it (``completes``) or none can.

    The first token's text then ends in what could begin a stop string, so a detokenizer
    holds that character back until it knows. Random weights: the prompt is searched for.
    """
    for seed in range(50):
        prompt = torch.randint(3, VOCAB, (21,), generator=torch.Generator().manual_seed(seed)).tolist()
        first, longer = (
            llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].text for n in (1, 8)
        )
        if first and len(longer) > len(first):
            stop = longer[len(first) - 1 : len(first) + 1] if completes else first[-1] + "\u2603\u2603"
            if stop not in first:
                return prompt, stop
    raise AssertionError("no prompt among 50 gives a first token whose text a later token extends")
