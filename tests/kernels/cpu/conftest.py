"""The CPU kernels' tests run on CPU tensors, whatever device the Triton kernel tests use."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _kernel_device():
    # Overrides tests/kernels/conftest.py's fixture of the same name (CUDA where there is a GPU).
    with torch.device("cpu"):
        yield
