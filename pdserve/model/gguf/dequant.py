"""GGUF tensor data -> float32, vectorized in torch for the common types, ``gguf.quants`` for the rest.

``gguf.quants.dequantize`` handles every type it knows, but walks large tensors in chunks of
rows in numpy: on this project's 2-core machine it takes about 18 s (under load) for the Q4_1
layers of SmolLM2-135M. The block formats below are done here in a handful of whole-tensor
torch operations instead, with results bit-identical to ``gguf.quants`` (tests compare them):

- ``Q8_0``: blocks of 32: float16 scale ``d``, 32 int8 ``q``; value ``q * d``.
- ``Q4_0``: blocks of 32: float16 ``d``, 16 bytes; low nibbles are values 0-15 of the block,
  high nibbles 16-31; value ``(q - 8) * d``.
- ``Q4_1``: like ``Q4_0`` with a float16 minimum ``m`` after ``d``; value ``q * d + m``.
- ``F32``, ``F16``, ``BF16``: a cast.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import _type_traits as _GGUF_TYPES  # the types gguf.quants (de)quantizes
from gguf.quants import dequantize as gguf_dequantize

Q = GGMLQuantizationType


_OWN = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1})


def can_dequantize(qtype: GGMLQuantizationType) -> bool:
    """Whether pdserve or the ``gguf`` package dequantizes ``qtype``."""
    return qtype in _OWN or qtype in _GGUF_TYPES


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of every block, as a float32 column."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Values 0..15 of each block: low nibbles (first half of the block), then high nibbles."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=1).float()


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 values of ``raw`` (the tensor's bytes, uint8) of type ``qtype``, in ``shape``;
    ``qtype`` is one ``can_dequantize`` accepts."""
    data = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))
    if qtype == Q.F32:
        return data.view(torch.float32).reshape(shape)
    if qtype == Q.F16:
        return data.view(torch.float16).float().reshape(shape)
    if qtype == Q.BF16:
        return data.view(torch.bfloat16).float().reshape(shape)
    if qtype == Q.Q8_0:
        blocks = data.view(-1, 34)
        return (blocks[:, 2:].contiguous().view(torch.int8).float() * _halves(blocks, 0)).reshape(shape)
    if qtype == Q.Q4_0:
        blocks = data.view(-1, 18)
        return ((_nibbles(blocks[:, 2:]) - 8.0) * _halves(blocks, 0)).reshape(shape)
    if qtype == Q.Q4_1:
        blocks = data.view(-1, 20)
        return (_nibbles(blocks[:, 4:]) * _halves(blocks, 0) + _halves(blocks, 2)).reshape(shape)
    rows = raw.reshape(-1, raw.size // max(1, int(np.prod(shape[:-1]))))
    return torch.from_numpy(np.asarray(gguf_dequantize(rows, qtype), dtype=np.float32)).reshape(shape)
