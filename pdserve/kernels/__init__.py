"""Triton kernels for pdserve, one op a file, each checked against ``TorchBackend``.

Importing this package on a machine without a CUDA device sets ``TRITON_INTERPRET=1``
(unless the variable is already set) so that every kernel runs in Triton's interpreter on
CPU. Triton reads the variable when a function is decorated with ``@triton.jit``, not when
triton is imported, so this works even if triton was imported earlier — as long as the
kernel modules themselves are first imported through this package, which is why they import
``pdserve.kernels`` (this file) before defining any kernel.

``TritonBackend`` (``pdserve.kernels.triton_backend``) implements ``pdserve.kernels.backend.Backend``
with these kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Whether the kernels run in Triton's interpreter (CPU tensors) rather than compiled."""
