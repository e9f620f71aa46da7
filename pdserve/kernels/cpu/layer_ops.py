"""A layer's small ops on CPU (``layer_ops.c``): RMSNorm with its residual add, rotary
embedding fused with the KV cache write, and SwiGLU's ``silu(gate) * up``, each one C call
instead of several torch ops; and greedy sampling's argmax over the logits."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.kernels.cpu.build import load_library

_SOURCE = Path(__file__).with_suffix(".c")


@functools.cache
def _library() -> ctypes.CDLL:
    library = load_library(_SOURCE)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    norm = library.pdserve_rms_norm
    norm.restype = None
    norm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
    rope = library.pdserve_rope_write_kv
    rope.restype = ctypes.c_int
    rope.argtypes = [
        ptr,
        i64,
        ptr,
        ptr,
        i64,  # q, q row stride, k, v, k/v row stride
        ptr,
        ptr,
        i64,  # positions, cos_sin, max positions
        i64,
        i64,
        i64,
        i64,  # tokens, heads, KV heads, head dim
        ptr,
        ptr,
        i64,
        i64,
        i64,
        i64,
        ptr,
        i64,  # caches, blocks, strides, slots, block size
        ctypes.c_int,  # threads
    ]
    silu_mul = library.pdserve_silu_mul
    silu_mul.restype = None
    silu_mul.argtypes = [ptr, ptr, i64, ptr, i64, i64, ctypes.c_int]
    argmax_rows = library.pdserve_argmax_rows
    argmax_rows.restype = None
    argmax_rows.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]
    return library


def load() -> None:
    """Build (or find the cached build of) the kernels now; raises ``CpuKernelsUnavailable``."""
    _library()


def _rows(x: torch.Tensor) -> bool:
    """A float32 [T, D] tensor whose every row is contiguous (a column slice is fine)."""
    return x.dtype == torch.float32 and x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] <= 1 or x.shape[0] == 0)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual`` (or ``x``); returns ``(rms_norm(r) * weight, r)``. x, residual [T, D]
    float32 with contiguous rows; weight [D] float32."""
    num_tokens, dim = x.shape
    if not (_rows(x) and weight.dtype == torch.float32 and weight.is_contiguous()):
        raise ValueError(f"rms_norm takes float32 rows and a contiguous weight, got {x.dtype} {tuple(x.stride())}")
    out = torch.empty(num_tokens, dim, dtype=torch.float32)
    total = x
    if residual is not None:
        if residual.shape != x.shape or not _rows(residual):
            raise ValueError(f"residual {tuple(residual.shape)} must be float32 rows shaped like x {tuple(x.shape)}")
        total = torch.empty(num_tokens, dim, dtype=torch.float32)
    if num_tokens:
        _library().pdserve_rms_norm(
            x.data_ptr(),
            x.stride(0),
            residual.data_ptr() if residual is not None else None,
            residual.stride(0) if residual is not None else 0,
            weight.data_ptr(),
            out.data_ptr(),
            total.data_ptr() if residual is not None else None,
            num_tokens,
            dim,
            eps,
            torch.get_num_threads(),
        )
    return out, total


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    layer_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q [T, H, D] in place and k [T, Hkv, D] into ``layer_cache`` [blocks, 2, Hkv,
    block_size, D] at ``slot_mapping``, v beside it (GPT-NeoX pairs, ``cos_sin`` [max_pos, D]);
    returns q. Every row of q, k, v contiguous per head; positions and slots int64."""
    num_tokens, num_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    num_blocks, _, _, block_size, _ = layer_cache.shape
    if q.stride()[1:] != (dim, 1) or k.stride()[1:] != (dim, 1) or v.stride() != k.stride():
        raise ValueError(
            f"q, k, v need contiguous heads and k, v equal strides: {q.stride()}, {k.stride()}, {v.stride()}"
        )
    if cos_sin.shape[1] != dim or not cos_sin.is_contiguous() or layer_cache.stride(-1) != 1:
        raise ValueError(f"cos_sin {tuple(cos_sin.shape)} must cover the head dim {dim}, contiguous")
    # Keys at index 0 of dim 1, values at 1: their addresses and strides without slicing the cache.
    block_stride, kv_stride, head_stride, token_stride, _ = layer_cache.stride()
    keys = layer_cache.data_ptr()
    values = keys + kv_stride * layer_cache.element_size()
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    status = _library().pdserve_rope_write_kv(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0),
        positions.data_ptr(),
        cos_sin.data_ptr(),
        cos_sin.shape[0],
        num_tokens,
        num_heads,
        num_kv_heads,
        dim,
        keys,
        values,
        num_blocks,
        block_stride,
        head_stride,
        token_stride,
        slots.data_ptr(),
        block_size,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError("a position is beyond the rotary table or a slot outside the cache")
    return q


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of gate, up [T, I] float32 with contiguous rows and one row stride
    (the halves of a fused gate/up projection, or two tensors alike); returns [T, I]."""
    if gate.shape != up.shape or gate.dim() != 2:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must be [tokens, size] alike")
    if not (_rows(gate) and _rows(up) and gate.stride() == up.stride()):
        raise ValueError(
            f"gate and up need float32 rows with one row stride, got {gate.dtype} {gate.stride()}, "
            f"{up.dtype} {up.stride()}"
        )
    num_tokens, size = gate.shape
    out = torch.empty(num_tokens, size, dtype=torch.float32)
    if num_tokens:
        _library().pdserve_silu_mul(
            gate.data_ptr(), up.data_ptr(), gate.stride(0), out.data_ptr(), num_tokens, size, torch.get_num_threads()
        )
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's ``argmax`` [R] int64 of logits [R, V] float32 with contiguous rows: the first
    largest value's column, a NaN counting as the largest, as ``torch.argmax``."""
    if not (_rows(logits) and logits.shape[1] > 0):
        raise ValueError(
            f"argmax takes float32 [rows, vocab > 0] with contiguous rows, got {logits.dtype} "
            f"{tuple(logits.shape)} strides {logits.stride()}"
        )
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        _library().pdserve_argmax_rows(
            logits.data_ptr(), rows, cols, logits.stride(0), out.data_ptr(), torch.get_num_threads()
        )
    return out
