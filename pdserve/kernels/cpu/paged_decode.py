"""Paged attention on CPU (``paged_decode.c``): queries over the cache, read in place.

``paged_decode`` takes single-token queries (decodes); ``paged_prefill`` prompts and chunks,
a query per token, each over the context up to its own position.

Serves both cache layouts: GQA keys and values are two views with the same strides
(``[blocks, kv_heads, tokens, dim]``); MLA's latents are one view read as keys (all of a
row) and as values (its first ``v_dim`` entries).
"""

from __future__ import annotations

import _ctypes
import ctypes
import functools
from pathlib import Path

import torch

from pdserve.kernels.cpu.build import load_library

_SOURCE = Path(__file__).with_suffix(".c")
_ERRORS = {
    -1: "out of memory for the kernel's scratch space",
    -2: "a block table entry is outside the cache",
    -3: "the prompt kernel takes head sizes 64 and 128 and blocks of a multiple of 16 tokens",
}


@functools.cache
def _kernel() -> _ctypes.CFuncPtr:
    function = load_library(_SOURCE).pdserve_paged_decode
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    function.restype = ctypes.c_int
    function.argtypes = [
        ptr,
        i64,
        ptr,
        ptr,
        i64,  # q, q row stride, k_cache, v_cache, num_blocks
        i64,
        i64,
        i64,  # block, head and token strides
        ptr,
        i64,
        ptr,  # block_tables, table_stride, seq_lens
        i64,
        i64,
        i64,
        i64,  # num_seqs, num_heads, num_kv_heads, block_size
        i64,
        i64,
        ctypes.c_float,
        ptr,
        ctypes.c_int,  # k_dim, v_dim, scale, out, num_threads
    ]
    return function


@functools.cache
def _prefill_kernel() -> _ctypes.CFuncPtr:
    function = load_library(_SOURCE).pdserve_paged_prefill
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    function.restype = ctypes.c_int
    function.argtypes = [
        ptr,
        i64,
        ptr,
        ptr,
        i64,  # q, q row stride, k_cache, v_cache, num_blocks
        i64,
        i64,
        i64,  # block, head and token strides
        ptr,
        i64,
        ptr,
        ptr,  # block_tables, table_stride, seq_lens, query_start
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,  # num_seqs, num_heads, num_kv_heads, block_size, head_dim, max_seq_len
        ctypes.c_float,
        ptr,
        ctypes.c_int,  # scale, out, num_threads
    ]
    return function


def has_vector_path(k_dim: int, v_dim: int, block_size: int) -> bool:
    """Whether the kernel's 16-token vector path serves this shape (``choose_attend`` in the C
    file): several times faster than its generic loop, fast enough to take prompts too."""
    return k_dim == v_dim and k_dim in (64, 128) and block_size % 16 == 0


def load() -> None:
    """Build (or find the cached build of) the kernel now; raises ``CpuKernelsUnavailable``."""
    _kernel()


def _heads_contiguous(q: torch.Tensor) -> torch.Tensor:
    """q [rows, heads, dim] whose heads lie one after another in each row, with any row stride:
    the q columns of a fused q/k/v projection's output are used in place, not copied."""
    _, num_heads, dim = q.shape
    return q if q.stride(2) == 1 and (q.stride(1) == dim or num_heads == 1) else q.contiguous()


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    v_dim: int,
) -> torch.Tensor:
    """Attention of q [S, H, Dk] (heads contiguous in each row; rows any stride) over each
    sequence's first ``seq_lens[s]`` cached tokens.

    ``k_cache``/``v_cache``: float32 ``[num_blocks, Hkv, block_size, Dk]`` views with equal
    strides and contiguous rows; ``block_tables`` [S, max_blocks] and ``seq_lens`` [S] int32;
    ``max_seq_len`` is ``max(seq_lens)``, known on the host. Returns [S, H, v_dim] float32.
    """
    num_seqs, num_heads, k_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    if not q.dtype == k_cache.dtype == v_cache.dtype == torch.float32:
        raise ValueError(f"the CPU decode kernel takes float32 only, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if num_heads % num_kv_heads or k_cache.shape[-1] != k_dim or v_cache.shape[-1] < v_dim:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit keys {tuple(k_cache.shape)} / values "
            f"{tuple(v_cache.shape)} with v_dim {v_dim}"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(
            f"keys and values need the same strides and contiguous rows, got {k_cache.stride()}, {v_cache.stride()}"
        )
    if max_seq_len > block_tables.shape[1] * block_size:
        raise ValueError(
            f"a context of {max_seq_len} tokens exceeds the block table's "
            f"{block_tables.shape[1]} blocks of {block_size}"
        )
    q = _heads_contiguous(q)
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty(num_seqs, num_heads, v_dim, dtype=torch.float32)
    status = _kernel()(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        num_blocks,
        k_cache.stride(0),
        k_cache.stride(1) if num_kv_heads > 1 else 0,
        k_cache.stride(2),
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        block_size,
        k_dim,
        v_dim,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"paged decode attention failed: {_ERRORS.get(status, f'status {status}')}")
    return out


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every sequence's new tokens q [T, H, D] (heads contiguous in each
    row) over its cached context.

    Sequence s owns rows ``query_start[s]:query_start[s + 1]`` of q, the last tokens of its
    ``seq_lens[s]``, whose keys and values are already in the cache. ``k_cache``/``v_cache``
    as for ``paged_decode``, with ``has_vector_path`` true for their shape; ``query_start``
    [S + 1] int32 from 0. Returns [T, H, D] float32.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    if {q.dtype, k_cache.dtype, v_cache.dtype} != {torch.float32}:
        raise ValueError(f"the CPU prompt kernel takes float32 only, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or v_cache.shape[-1] != head_dim:
        raise ValueError(
            f"keys {tuple(k_cache.shape)} and values {tuple(v_cache.shape)} need the same shape and "
            f"strides, with contiguous rows"
        )
    if query_start.shape[0] != seq_lens.shape[0] + 1 or int(query_start[-1]) != num_tokens:
        raise ValueError(f"query_start {query_start.tolist()} does not cover the {num_tokens} query rows")
    if max_seq_len > block_tables.shape[1] * block_size:
        raise ValueError(
            f"a context of {max_seq_len} tokens exceeds the block table's "
            f"{block_tables.shape[1]} blocks of {block_size}"
        )
    q = _heads_contiguous(q)
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    starts = query_start.to(torch.int32).contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    status = _prefill_kernel()(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        num_blocks,
        k_cache.stride(0),
        k_cache.stride(1) if num_kv_heads > 1 else 0,
        k_cache.stride(2),
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        starts.data_ptr(),
        lens.shape[0],
        num_heads,
        num_kv_heads,
        block_size,
        head_dim,
        max_seq_len,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"paged prompt attention failed: {_ERRORS.get(status, f'status {status}')}")
    return out
