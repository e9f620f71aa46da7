"""Which ``Backend`` a model runs on: the one place that knows every implementation."""

from __future__ import annotations

import logging

import torch

from pdserve.kernels.backend import Backend

logger = logging.getLogger(__name__)


def select_backend(kernels: str, device: torch.device) -> Backend:
    """``auto``: Triton kernels on CUDA; on CPU the C kernels, or the torch reference when
    they cannot be built here (no C compiler), with a warning saying so."""
    if kernels == "triton" or (kernels == "auto" and device.type == "cuda"):
        from pdserve.kernels.triton_backend import TritonBackend

        return TritonBackend()
    from pdserve.kernels.torch_backend import TorchBackend

    if kernels == "torch":
        return TorchBackend()
    if device.type != "cpu":
        raise ValueError(f"kernels='cpu' runs on the CPU only, not on {device}")
    from pdserve.kernels.cpu.build import CpuKernelsUnavailable
    from pdserve.kernels.cpu.cpu_backend import CpuBackend

    try:
        return CpuBackend()
    except CpuKernelsUnavailable as exc:
        if kernels == "cpu":
            raise
        logger.warning("CPU kernels unavailable, running the slower torch reference: %s", exc)
        return TorchBackend()
