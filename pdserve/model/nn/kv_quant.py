"""An FP8 KV cache (``kv_cache_dtype="fp8_e4m3"``): per-layer scales, quantized on write.

Each layer stores ``value / scale`` rounded to float8_e4m3fn (clamped to its ±448), with one
scale for its keys and one for its values: the checkpoint's ``<attention>.k_scale`` and
``<attention>.v_scale`` where it has them (calibrated FP8 checkpoints do), else 1. MLA caches
one latent per token, keys and values at once, under ``k_scale``.

Attention dequantizes on read without touching each value twice: the backend upcasts what it
reads (exact from FP8) and the scales are folded in, the key scale into the softmax scale
(``q · (k s) = (q · k) s``) and the value scale into the output (``Σ p (v s) = s Σ p v``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.model.kv_cache import KV_FP8_DTYPE
from pdserve.model.weights import Checkpoint

_FP8_MAX = 448.0


@dataclass(frozen=True)
class KVScales:
    """One attention layer's scales; they matter only when its cache is FP8."""

    k_scale: float = 1.0
    v_scale: float = 1.0

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, prefix: str) -> KVScales:
        def read(name: str) -> float:
            if name not in ckpt:
                return 1.0
            value = float(ckpt.get(name, (), dtype=torch.float32))
            if not value > 0:
                raise ValueError(f"{ckpt.path}: KV cache scale {name} must be > 0, got {value}")
            return value

        return cls(read(f"{prefix}.k_scale"), read(f"{prefix}.v_scale"))


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == KV_FP8_DTYPE


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` as the cache stores it: clamped to FP8's range, rounded to nearest even."""
    return (x.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(KV_FP8_DTYPE)
