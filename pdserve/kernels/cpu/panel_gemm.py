"""Linear layers on CPU (``panel_gemm.c``): float32 weights packed once into 32-column panels,
and the GEMM that reads them, faster than oneDNN's with a decode step's few rows.

SwiGLU's gate and up projections pack into gated panels (``pack_gated``), whose GEMM
(``gated_linear``) returns ``silu(gate) * up`` directly."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.kernels.cpu.build import load_library

_SOURCE = Path(__file__).with_suffix(".c")
PANEL = 32  # columns a panel holds
GATED_COLUMNS = PANEL // 2  # a gated panel's gate columns, followed by as many up columns


@dataclass(frozen=True)
class PanelWeight:
    """A linear weight [out, in] as panels [ceil(out / 32), in, 32], the last zero-padded.

    ``gated``: the weight [2 · out, in] of gate then up rows, as panels [ceil(out / 16), in, 32]
    of 16 gate columns and the same 16 up columns; ``out_features`` is then the activation's
    width, half the weight's rows.
    """

    panels: torch.Tensor
    out_features: int
    gated: bool = False

    @property
    def shape(self) -> torch.Size:
        rows = 2 * self.out_features if self.gated else self.out_features
        return torch.Size((rows, self.panels.shape[1]))


@functools.cache
def _library() -> ctypes.CDLL:
    library = load_library(_SOURCE)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.pdserve_panel_gemm_available.restype = ctypes.c_int
    gemm = library.pdserve_panel_gemm
    gemm.restype = None
    gemm.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int, ctypes.c_int]
    return library


def available() -> bool:
    """Whether this CPU runs the kernel (it needs AVX-512); raises ``CpuKernelsUnavailable``
    when it cannot be built."""
    return bool(_library().pdserve_panel_gemm_available())


def pack(weight: torch.Tensor) -> PanelWeight:
    """``weight`` [out, in] float32 as panels (a copy)."""
    out_features, in_features = weight.shape
    padded = F.pad(weight, (0, 0, 0, -out_features % PANEL)) if out_features % PANEL else weight
    panels = padded.view(-1, PANEL, in_features).transpose(1, 2).contiguous()
    return PanelWeight(panels, out_features)


def pack_gated(weight: torch.Tensor) -> PanelWeight:
    """``weight`` [2 · out, in] float32, gate rows then up rows, as gated panels (a copy)."""
    if weight.shape[0] % 2:
        raise ValueError(f"a gated weight stacks gate and up rows of one size, got {weight.shape[0]} rows")
    out_features, in_features = weight.shape[0] // 2, weight.shape[1]
    pad = -out_features % GATED_COLUMNS
    gate, up = (F.pad(half, (0, 0, 0, pad)).view(-1, GATED_COLUMNS, in_features) for half in weight.chunk(2))
    panels = torch.cat((gate, up), dim=1).transpose(1, 2).contiguous()
    return PanelWeight(panels, out_features, gated=True)


def linear(x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., in] · weightᵀ + bias`` → [..., out] float32; x and bias float32."""
    if weight.gated:
        raise ValueError("a gated weight runs through gated_linear")
    return _gemm(x, weight, bias)


def gated_linear(x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` → [..., out] float32, where ``gate, up`` are the halves of
    ``x [..., in] · Wᵀ + bias`` for the gated weight W [2 · out, in]; x and bias [2 · out] float32."""
    if not weight.gated:
        raise ValueError("gated_linear takes a weight packed by pack_gated")
    return _gemm(x, weight, bias)


def _gemm(x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None) -> torch.Tensor:
    in_features = weight.panels.shape[1]
    if x.dtype != torch.float32 or x.shape[-1] != in_features:
        raise ValueError(f"linear takes float32 [..., {in_features}], got {x.dtype} {tuple(x.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (weight.shape[0],)):
        raise ValueError(f"bias must be float32 [{weight.shape[0]}], got {bias.dtype} {tuple(bias.shape)}")
    # A decode step makes over a hundred of these calls: plain 2-D inputs skip the reshapes.
    flat = x.dim() == 2
    rows = x if flat else x.reshape(-1, in_features)
    if rows.shape[0] and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weight.out_features, dtype=torch.float32)
    if rows.shape[0]:
        _library().pdserve_panel_gemm(
            rows.data_ptr(),
            rows.shape[0],
            in_features,
            rows.stride(0),
            weight.panels.data_ptr(),
            weight.out_features,
            bias.contiguous().data_ptr() if bias is not None else None,
            out.data_ptr(),
            torch.get_num_threads(),
            weight.gated,
        )
    return out if flat else out.view(*x.shape[:-1], weight.out_features)
