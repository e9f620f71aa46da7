"""How a tensor-parallel rank takes its share of a model.

The Megatron split: a column-parallel linear keeps a slice of its output rows, a row-parallel
one a slice of its input columns, and one all-reduce after each attention block and each MLP
sums the row-parallel partials. Attention heads split evenly; KV heads split too, or are
replicated when there are more ranks than KV heads (each rank keeps the one its query heads
read). The embedding and the LM head split the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.distributed.parallel_state import ParallelState
from pdserve.kernels.backend import Backend


def split(total: int, parallel: ParallelState, what: str) -> slice:
    """This rank's even share of ``total`` things; a clear error when they do not divide."""
    size = parallel.tp_size
    if total % size:
        raise ValueError(f"{what} ({total}) does not divide by tensor_parallel_size {size}")
    share = total // size
    return slice(parallel.tp_rank * share, (parallel.tp_rank + 1) * share)


@dataclass(frozen=True)
class HeadShare:
    """The query heads and KV heads one rank computes (``heads`` and ``kv_heads`` index heads)."""

    heads: slice
    kv_heads: slice

    @property
    def num_heads(self) -> int:
        return self.heads.stop - self.heads.start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads.stop - self.kv_heads.start


def head_share(num_heads: int, num_kv_heads: int, parallel: ParallelState) -> HeadShare:
    """Split heads over the ranks: KV heads evenly, or replicated when there are fewer of them
    than ranks (rank r then keeps the KV head its query heads belong to)."""
    size = parallel.tp_size
    heads = split(num_heads, parallel, "num_attention_heads")
    if num_kv_heads >= size:
        return HeadShare(heads, split(num_kv_heads, parallel, "num_key_value_heads"))
    if size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {size} is more than num_key_value_heads ({num_kv_heads}) and not a multiple "
            "of it: KV heads cannot be replicated evenly"
        )
    group = num_heads // num_kv_heads  # query heads per KV head
    first = heads.start // group
    return HeadShare(heads, slice(first, first + 1))


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank's cache holds (1 when they are replicated)."""
    return max(num_kv_heads // tp_size, 1)


class VocabParallelEmbedding:
    """Each rank embeds the token ids in its slice of the vocabulary; an all-reduce sums them."""

    def __init__(self, weight: torch.Tensor, parallel: ParallelState) -> None:
        self.parallel = parallel
        self.rows = _vocab_rows(weight.shape[0], parallel)
        self.weight = _padded_rows(weight, self.rows)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.rows.start
        mine = (local >= 0) & (local < self.rows.stop - self.rows.start)
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine.unsqueeze(-1)
        return self.parallel.tp_all_reduce(out)


class ParallelLMHead:
    """Each rank computes the logits of its slice of the vocabulary; an all-gather joins them."""

    def __init__(self, weight: torch.Tensor, parallel: ParallelState, backend: Backend) -> None:
        self.vocab_size = weight.shape[0]
        self.parallel = parallel
        self.backend = backend
        self.weight = backend.prepare_weight(_padded_rows(weight, _vocab_rows(self.vocab_size, parallel)))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.backend.logits(hidden, self.weight)
        if self.parallel.tp_size == 1:
            return logits
        return self.parallel.tp_all_gather(logits)[:, : self.vocab_size]


def _vocab_rows(vocab_size: int, parallel: ParallelState) -> slice:
    """Rank r's rows of a vocabulary padded to a multiple of the ranks."""
    share = -(-vocab_size // parallel.tp_size)
    return slice(parallel.tp_rank * share, (parallel.tp_rank + 1) * share)


def _padded_rows(weight: torch.Tensor, rows: slice) -> torch.Tensor:
    """``weight[rows]``, zero rows standing in for the padding past the vocabulary."""
    if rows.start == 0 and rows.stop == weight.shape[0]:
        return weight
    out = weight.new_zeros((rows.stop - rows.start, *weight.shape[1:]))
    real = weight[rows]
    out[: real.shape[0]] = real
    return out


def row_parallel_bias(has_bias: bool, parallel: ParallelState) -> bool:
    """Only rank 0 adds a row-parallel linear's bias: the all-reduce would add it N times."""
    return has_bias and parallel.tp_rank == 0
