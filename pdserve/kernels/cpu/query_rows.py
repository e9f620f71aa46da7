"""Which of a step's tokens the C attention kernel takes, each as a one-token query.

A decode is one query over its context. A prompt (or a chunk of one) is as many queries as it
has tokens, each over the context up to and including its own position: causal attention,
exactly. Run that way through the C kernel, a short prompt's attention is about twice as fast
as torch's SDPA on it (one call per sequence, with little to tile); past a few hundred tokens
SDPA's tiling wins, so long contexts stay with it (bench/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kernels.backend import AttentionMetadata

# Prompts whose context is at most this many tokens go through the C kernel; longer ones through
# SDPA. Measured on the SmolLM2 shape: the kernel is 1.25x faster at 512 tokens, slower at 768.
SHORT_CONTEXT_TOKENS = 512


@dataclass
class QueryRows:
    """The step's tokens that run as one-token queries, and what each attends to."""

    meta: AttentionMetadata  # the step these rows belong to
    rows: torch.Tensor | None  # [N] indices into the step's tokens; None: every token, in order
    tables: torch.Tensor  # [N, max_blocks] int32: each query's sequence's block table
    lens: torch.Tensor  # [N] int32: each query's context, its own position included
    max_len: int
    long_seqs: list[tuple[int, int, int]]  # (sequence, first token row, query length): left to SDPA


def query_rows(meta: AttentionMetadata) -> QueryRows:
    """Every decode, and every token of the prompts with a short context."""
    seq_index, lens, rows, long_seqs = [], [], [], []
    start = 0
    for seq, (qlen, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        if qlen == 1 or seq_len <= SHORT_CONTEXT_TOKENS:
            seq_index.append(np.full(qlen, seq))
            lens.append(np.arange(seq_len - qlen + 1, seq_len + 1))
            rows.append(np.arange(start, start + qlen))
        else:
            long_seqs.append((seq, start, qlen))
        start += qlen
    if not rows:
        empty = torch.empty(0, dtype=torch.int32)
        return QueryRows(meta, torch.empty(0, dtype=torch.int64), empty.view(0, 0), empty, 0, long_seqs)
    lens_np = np.concatenate(lens).astype(np.int32)
    index = torch.from_numpy(np.concatenate(seq_index))
    return QueryRows(
        meta=meta,
        rows=None if not long_seqs else torch.from_numpy(np.concatenate(rows)),
        tables=meta.block_tables.index_select(0, index),
        lens=torch.from_numpy(lens_np),
        max_len=int(lens_np.max()),
        long_seqs=long_seqs,
    )
