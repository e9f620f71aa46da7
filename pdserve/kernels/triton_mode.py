"""Whether pdserve's Triton kernels run compiled on a GPU or in Triton's interpreter on CPU.

Triton reads ``TRITON_INTERPRET`` when a function is decorated with ``@triton.jit``, not when
triton is imported. So the choice is made once per process, before the first kernel module
(one that defines a ``@triton.jit`` function) is imported:

- ``use_interpreter_without_cuda`` makes it: without a CUDA device it sets
  ``TRITON_INTERPRET=1`` (unless the variable is already set). ``triton_backend``, which loads
  the kernels, calls it before importing them; nothing else changes the environment.
- ``interpreted`` reads it, for kernel modules to specialise on. Called by a kernel module
  imported before the choice was made on a machine without CUDA (whose kernels would be
  compiled for a GPU that is not there and fail on CPU tensors), it raises instead.
"""

from __future__ import annotations

import os

import torch


def use_interpreter_without_cuda() -> bool:
    """Select Triton's interpreter unless a CUDA device is present or ``TRITON_INTERPRET`` is
    set already; return whether the kernels run interpreted."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return interpreted()


def interpreted() -> bool:
    """Whether ``@triton.jit`` functions defined now run in Triton's interpreter (CPU tensors).

    RuntimeError on a machine without CUDA where nobody chose: ``TRITON_INTERPRET=0`` set on
    purpose (compiling for a GPU ahead of time, as tests/kernels/test_compile_sm90.py does) is
    a choice, and is kept."""
    choice = os.environ.get("TRITON_INTERPRET")
    if choice is None and not torch.cuda.is_available():
        raise RuntimeError(
            "pdserve's Triton kernels need a CUDA device or Triton's interpreter: call "
            "pdserve.kernels.triton_mode.use_interpreter_without_cuda() before importing them "
            "(pdserve.kernels.triton_backend does), or set TRITON_INTERPRET=1"
        )
    return choice == "1"
