"""Block-quantized FP8 linears (DeepSeek-V3's format): the weight form and the torch reference.

A weight W [out, in] is stored as ``float8_e4m3fn`` values and a float32 ``scale_inv``
[ceil(out / bo), ceil(in / bi)]: the real weight is ``W[i, j] * scale_inv[i // bo, j // bi]``,
edge blocks partial. At run time activations are quantized the same way along their columns
(DeepSeek's inference scheme): each token's ``bi`` columns of group g get the scale
``amax / 448`` and are rounded to FP8. Then, per column group g,

    y[m, n] = Σ_g (Σ_{k in g} xq[m, k] · wq[n, k]) · x_scale[m, g] · w_scale[n // bo, g]

accumulated in float32 group by group, in that order of operations. ``block_fp8_linear``
below is that arithmetic in torch; the Triton kernel (``block_fp8_gemm.py``) does the same
and is tested exactly against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclass(frozen=True)
class BlockFP8Weight:
    """A linear weight kept in FP8 with one float32 scale per ``block_size`` block."""

    weight: torch.Tensor  # [out, in] float8_e4m3fn
    scale_inv: torch.Tensor  # [ceil(out / bo), ceil(in / bi)] float32
    block_size: tuple[int, int]  # (bo, bi)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype``: each value times its block's scale (computed in float32)."""
        return dequantize_block_fp8(self.weight, self.scale_inv, self.block_size, dtype)

    @staticmethod
    def cat(parts: Sequence[BlockFP8Weight]) -> BlockFP8Weight | None:
        """The parts stacked along ``out`` (a merged linear); None when a part but the last ends
        inside a block of ``bo`` rows, since the scales of a block cannot be split."""
        block_size = parts[0].block_size
        if any(p.block_size != block_size for p in parts) or any(p.shape[0] % block_size[0] for p in parts[:-1]):
            return None
        return BlockFP8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale_inv for p in parts]), block_size)


def expected_scale_shape(shape: Sequence[int], block_size: tuple[int, int]) -> tuple[int, int]:
    """``[ceil(out / bo), ceil(in / bi)]`` for a weight of ``shape`` [out, in]."""
    return (-(-shape[0] // block_size[0]), -(-shape[1] // block_size[1]))


def expand_scales(scale: torch.Tensor, rows: int, cols: int, block_size: tuple[int, int]) -> torch.Tensor:
    """Per-block scales [ceil(rows / bo), ceil(cols / bi)] → one per element [rows, cols]."""
    bo, bi = block_size
    return scale.repeat_interleave(bo, dim=0)[:rows].repeat_interleave(bi, dim=1)[:, :cols]


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """``weight`` [out, in] FP8 times its blocks' ``scale_inv``, in float32, then cast to ``dtype``."""
    out, inp = weight.shape
    return (weight.float() * expand_scales(scale_inv.float(), out, inp, block_size)).to(dtype)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and per ``group`` columns: ``scale = amax / 448`` (1 for an all-zero group) and
    ``x / scale`` rounded to FP8. Returns (xq [M, K] fp8, scale [M, ceil(K / group)] float32)."""
    m, k = x.shape
    num_groups = -(-k // group)
    padded = torch.zeros(m, num_groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    groups = padded.view(m, num_groups, group)
    amax = groups.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (groups / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.view(m, -1)[:, :k], scale


def block_fp8_linear(x: torch.Tensor, weight: BlockFP8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., in] · Wᵀ (+ bias)`` with W block-FP8 and x quantized per token and group, in
    x's dtype: the reference arithmetic of the module docstring."""
    bo, bi = weight.block_size
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)
    xq, x_scale = quantize_activations(rows, bi)
    w_scale = weight.scale_inv.float().repeat_interleave(bo, dim=0)[:out_features]  # [out, groups]
    acc = torch.zeros(rows.shape[0], out_features, dtype=torch.float32, device=x.device)
    for g in range(x_scale.shape[1]):
        cols = slice(g * bi, min((g + 1) * bi, in_features))
        partial = xq[:, cols].float() @ weight.weight[:, cols].float().T
        acc += partial * x_scale[:, g : g + 1] * w_scale[None, :, g]
    if bias is not None:
        acc += bias.float()
    return acc.to(x.dtype).reshape(*x.shape[:-1], out_features)
