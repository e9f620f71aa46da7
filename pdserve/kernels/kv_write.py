"""Writing a step's new K/V (GQA) or latents (MLA) into their paged slots.

The per-layer cache views are non-contiguous slices of the whole pool
(``[num_blocks, num_layers, ...]``), so every stride is passed in. One program per token.
Negative slots are skipped, so a caller may pad ``slot_mapping`` with -1 (the reference has
no such convention; pdserve's scheduler never emits one today).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.common import cast


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ckv,
    stride_ch,
    stride_cs,
    num_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_heads) & (dims < head_dim)
        k = tl.load(k_ptr + tok * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(v_ptr + tok * stride_vt + heads * stride_vh + dims, mask=mask)
        dst = cache_ptr + block * stride_cb + heads * stride_ch + offset * stride_cs + dims
        tl.store(dst, cast(k, cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_ckv, cast(v, cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_latent_kernel(
    lat_ptr,
    cache_ptr,
    slot_ptr,
    stride_lt,
    stride_cb,
    stride_cs,
    width,
    block_size,
    BLOCK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        cols = tl.arange(0, BLOCK)
        lat = tl.load(lat_ptr + tok * stride_lt + cols, mask=cols < width)
        dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + cols
        tl.store(dst, cast(lat, cache_ptr.dtype.element_ty), mask=cols < width)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, Hkv, D] into ``layer_cache`` [num_blocks, 2, Hkv, block_size, D] in place."""
    if layer_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens:
        _write_kv_kernel[(num_tokens,)](
            k,
            v,
            layer_cache,
            slot_mapping,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            layer_cache.stride(0),
            layer_cache.stride(1),
            layer_cache.stride(2),
            layer_cache.stride(3),
            num_heads,
            head_dim,
            layer_cache.shape[3],
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )


def write_latent(layer_cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store MLA latents [T, L] into ``layer_cache`` [num_blocks, block_size, L] in place."""
    if layer_cache.stride(-1) != 1:
        raise ValueError("the latent cache's last dim must be contiguous")
    latent = _last_dim_contiguous(latent)
    num_tokens, width = latent.shape
    if num_tokens:
        _write_latent_kernel[(num_tokens,)](
            latent,
            layer_cache,
            slot_mapping,
            latent.stride(0),
            layer_cache.stride(0),
            layer_cache.stride(1),
            width,
            layer_cache.shape[1],
            BLOCK=triton.next_power_of_2(width),
        )
