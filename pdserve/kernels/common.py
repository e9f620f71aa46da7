"""Helpers the kernels share (not an op of their own)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_mode import interpreted

# Before any @triton.jit below: raises where they would be compiled for a missing GPU.
INTERPRETED = interpreted()


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """``tl.dot`` with float32 accumulation; ``IEEE`` computes it in full float32.

    IEEE is needed for float32 inputs (``tl.dot`` would otherwise use TF32 on a GPU and
    miss the reference by ~1e-3) and in the interpreter, whose bf16 ``tl.dot`` (Triton
    3.9) multiplies the raw uint16 bit patterns. Upcasting bf16/fp16 to fp32 is exact, and
    the products of two bf16 numbers are exact in fp32, so the result equals a native
    bf16 dot with fp32 accumulation up to summation order.
    """
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


def ieee_dot(dtype: torch.dtype) -> bool:
    """The ``IEEE`` flag of ``dot`` for operands of ``dtype``."""
    return INTERPRETED or dtype == torch.float32


def dot_block(n: int, cap: int | None = None) -> int:
    """A power-of-two tile covering ``n`` and at least 16 wide, as ``tl.dot`` needs on a GPU."""
    size = max(16, triton.next_power_of_2(max(1, n)))
    return size if cap is None else min(size, cap)


_INTERPRETED = tl.constexpr(INTERPRETED)


@triton.jit
def cast(x, dtype: tl.constexpr):
    """``x.to(dtype)`` rounding to nearest-even, as a GPU and torch do.

    Triton 3.9's interpreter truncates float32 → bfloat16 (it drops the low 16 bits), which
    biases every bf16 result towards zero and misses torch by up to an ulp (and it flushes
    subnormals). There, the rounding is done here on the bits and the top 16 bits are
    reinterpreted as bf16. NaN and inf keep their class.
    """
    if _INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
