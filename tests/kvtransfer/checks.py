"""Expected contents of pulled blocks, compared element by element."""

from __future__ import annotations

import msgspec
import torch

from tests.kvtransfer import protocol as p


def global_pool(prefill: p.PeerConfig) -> torch.Tensor:
    """GQA: the whole model's pool (all heads) the prefill group's ranks are slices of."""
    return p.prefill_contents(msgspec.structs.replace(prefill, tp_size=1, tp_rank=0))


def assert_blocks(
    actual_pool: torch.Tensor, local_ids: list[int], expected_pool: torch.Tensor, remote_ids: list[int]
) -> None:
    """``actual_pool[local_ids[i]] == expected_pool[remote_ids[i]]`` element by element
    (compared as integers of the same width, so NaN bit patterns compare too)."""
    assert len(local_ids) == len(remote_ids)
    int_type = {1: torch.int8, 2: torch.int16, 4: torch.int32}[actual_pool.element_size()]
    for position, (lb, rb) in enumerate(zip(local_ids, remote_ids)):
        got, want = actual_pool[lb].view(int_type), expected_pool[rb].view(int_type)
        assert got.shape == want.shape, (got.shape, want.shape)
        wrong = (got != want).sum().item()
        assert wrong == 0, f"block {position} (local {lb} <- remote {rb}): {wrong} of {got.numel()} elements differ"


def heads_of(pool: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """GQA pool ``[blocks, layers, 2, heads, tokens, dim]`` restricted to TP rank ``rank``'s heads."""
    per_rank = pool.shape[3] // size
    return pool[:, :, :, rank * per_rank : (rank + 1) * per_rank]
