"""Structured outputs in the sampler: the tokens a request's grammar forbids get -inf logits.

One int32 bitmask holds the batch's constrained rows, ``(vocab + 31) // 32`` words a row, bit
``t % 32`` of word ``t // 32`` set when token ``t`` is allowed (llguidance's layout, as vLLM
and sglang use it). llguidance fills the rows on CPU, in parallel on its own threads; the mask
then moves to the logits' device (a few kB), is unpacked to booleans there and applied with one
``masked_fill``, so the same code serves CPU and GPU logits.
"""

from __future__ import annotations

import llguidance
import torch

_BITS = 32


class GrammarMask:
    """Applies the grammars of a batch's constrained rows to its logits; one per sampler."""

    def __init__(self) -> None:
        self._executor: llguidance.LLExecutor | None = None  # its thread pool starts at first use

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, llguidance.LLMatcher]]) -> None:
        """Set to -inf, in place, the logits [num_rows, vocab] of the tokens that each
        ``(row, matcher)``'s grammar does not allow next."""
        if not rows:
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        vocab = logits.shape[-1]
        num_words = (vocab + _BITS - 1) // _BITS
        bitmask = torch.empty(len(rows), num_words, dtype=torch.int32)  # [num_constrained, num_words]
        self._executor.unsafe_compute_mask_ptr(
            [(matcher, i) for i, (_, matcher) in enumerate(rows)], bitmask.data_ptr(), num_words * 4, len(rows)
        )
        allowed = unpack(bitmask.to(logits.device, non_blocking=True), vocab)
        index = torch.tensor([row for row, _ in rows], device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The booleans [num_rows, vocab] of an int32 ``bitmask`` [num_rows, ceil(vocab / 32)]."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [num_rows, num_words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
