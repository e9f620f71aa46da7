"""Kernel tests create their tensors on the kernels' device: CUDA when compiled, else CPU."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import DEVICE


@pytest.fixture(autouse=True)
def _kernel_device():
    # torch's default device, so each test's torch.randn/tensor/full lands where the kernels run.
    with torch.device(DEVICE):
        yield
