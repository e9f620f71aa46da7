"""Building blocks shared by the model files: norms, linears, rotary tables, the dense MLP.

Layers hold plain tensors pulled from a ``Checkpoint`` and call the ``Backend`` for the
maths that has a kernel; nothing here is an ``nn.Module`` because nothing here trains.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pdserve.distributed.parallel_state import SINGLE_RANK, ParallelState
from pdserve.kernels.backend import Backend
from pdserve.kernels.block_fp8 import BlockFP8Weight
from pdserve.model.nn.tensor_parallel import row_parallel_bias, split
from pdserve.model.weights import Checkpoint


def linear_weight(
    ckpt: Checkpoint,
    name: str,
    shape: tuple[int, int],
    backend: Backend,
    rows: slice | None = None,
    cols: slice | None = None,
) -> torch.Tensor | BlockFP8Weight:
    """Weight ``name`` [out, in] of a linear, or its ``rows``/``cols`` shard (tensor parallelism):
    kept block-FP8 when it is stored so and the backend runs it so, else in the model dtype (an
    FP8 weight dequantized). A shard of an FP8 weight is dequantized: its blocks need not line up."""
    if rows is None and cols is None:
        if backend.runs_block_fp8 and ckpt.is_block_fp8(name):
            return ckpt.get_block_fp8(name, shape)
        return ckpt.get(name, shape)
    return shard(ckpt.get(name, shape), rows, cols)


def shard(tensor: torch.Tensor, rows: slice | None, cols: slice | None = None) -> torch.Tensor:
    """``tensor[rows, cols]`` as its own contiguous tensor (a rank keeps only its share)."""
    if rows is not None:
        tensor = tensor[rows]
    if cols is not None:
        tensor = tensor[:, cols]
    return tensor.contiguous()


class Linear:
    """``x · Wᵀ + b``, with W in the form the backend's GEMM reads fastest (``prepare_weight``).

    Tensor parallelism keeps a shard: ``rows`` of the output (column-parallel) or ``cols`` of
    the input (row-parallel; the caller sums the ranks' partial outputs, and only one rank
    adds the bias: pass ``bias=False`` on the others).
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        name: str,
        in_features: int,
        out_features: int,
        backend: Backend,
        bias: bool = False,
        *,
        rows: slice | None = None,
        cols: slice | None = None,
    ) -> None:
        weight = linear_weight(ckpt, f"{name}.weight", (out_features, in_features), backend, rows, cols)
        self.weight = backend.prepare_weight(weight)
        self.bias = shard(ckpt.get(f"{name}.bias", (out_features,)), rows) if bias else None
        self.backend = backend

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.weight, self.bias)


class MergedLinear:
    """Linears that read the same input (q/k/v, gate/up) run as one GEMM.

    Their weights are concatenated once at load time (a copy; every other weight stays a
    view of the mapped checkpoint unless the backend repacks it): one GEMM and one kernel
    launch instead of two or three. Returns each linear's output, as column slices of the
    one result.
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        names: tuple[str, ...],
        in_features: int,
        out_features: tuple[int, ...],
        backend: Backend,
        bias: bool = False,
        rows: tuple[slice, ...] | None = None,
    ) -> None:
        """``rows``: with tensor parallelism, the share of each linear's output this rank keeps."""
        weight, self.out_features, self.bias = _stacked(ckpt, names, in_features, out_features, backend, bias, rows)
        self.weight = backend.prepare_weight(weight)
        self.backend = backend

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.backend.linear(x, self.weight, self.bias).split(self.out_features, dim=-1)


class GatedLinear:
    """SwiGLU's gate and up projections as one GEMM that returns ``silu(gate(x)) * up(x)``
    (``Backend.gated_linear``): a backend may apply the activation as the GEMM stores its
    output, so that the two projections are never written out whole."""

    def __init__(
        self,
        ckpt: Checkpoint,
        gate: str,
        up: str,
        in_features: int,
        out_features: int,
        backend: Backend,
        bias: bool = False,
        rows: slice | None = None,
    ) -> None:
        """``rows``: with tensor parallelism, this rank's share of the intermediate size."""
        shares = (rows, rows) if rows is not None else None
        weight, _, self.bias = _stacked(ckpt, (gate, up), in_features, (out_features,) * 2, backend, bias, shares)
        self.weight = backend.prepare_gated_weight(weight)
        self.backend = backend

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.gated_linear(x, self.weight, self.bias)


def _stacked(
    ckpt: Checkpoint,
    names: tuple[str, ...],
    in_features: int,
    out_features: tuple[int, ...],
    backend: Backend,
    bias: bool,
    rows: tuple[slice, ...] | None,
) -> tuple[torch.Tensor | BlockFP8Weight, list[int], torch.Tensor | None]:
    """The linears' weights stacked along ``out`` (a copy), each part's rows, and their biases."""
    shares = rows or (None,) * len(names)
    parts = [
        linear_weight(ckpt, f"{name}.weight", (size, in_features), backend, share)
        for name, size, share in zip(names, out_features, shares)
    ]
    stacked_bias = (
        torch.cat([shard(ckpt.get(f"{n}.bias", (size,)), share) for n, size, share in zip(names, out_features, shares)])
        if bias
        else None
    )
    return _concatenate(parts, ckpt.dtype), [p.shape[0] for p in parts], stacked_bias


def _concatenate(parts: list[torch.Tensor | BlockFP8Weight], dtype: torch.dtype) -> torch.Tensor | BlockFP8Weight:
    """The parts stacked along ``out``: still block-FP8 when all are and their blocks line up
    (each part but the last a whole number of blocks tall), else in ``dtype``."""
    fp8_parts = [p for p in parts if isinstance(p, BlockFP8Weight)]
    if len(fp8_parts) == len(parts):
        merged = BlockFP8Weight.cat(fp8_parts)
        if merged is not None:
            return merged
    return torch.cat([p.dequantize(dtype) if isinstance(p, BlockFP8Weight) else p for p in parts])


class RMSNorm:
    def __init__(self, ckpt: Checkpoint, name: str, size: int, eps: float, backend: Backend) -> None:
        self.weight = ckpt.get(f"{name}.weight", (size,))
        self.eps = eps
        self.backend = backend

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(norm(x + residual), x + residual)``."""
        return self.backend.rms_norm(x, self.weight, self.eps, residual)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)[0]


class DenseMLP:
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``, gate and up one ``GatedLinear``.

    With tensor parallelism each rank keeps a slice of the intermediate size (gate/up
    column-parallel, down row-parallel) and ``__call__`` sums the ranks' partials; ``partial``
    leaves the sum to a caller that has more to add first (a MoE's shared experts). Pass
    ``SINGLE_RANK`` for a replicated MLP (data-parallel attention keeps dense layers whole).
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        name: str,
        hidden: int,
        intermediate: int,
        backend: Backend,
        bias: bool = False,
        parallel: ParallelState = SINGLE_RANK,
    ) -> None:
        share = split(intermediate, parallel, f"{name} intermediate size")
        self.gate_up = GatedLinear(
            ckpt,
            f"{name}.gate_proj",
            f"{name}.up_proj",
            hidden,
            intermediate,
            backend,
            bias,
            rows=share if parallel.tp_size > 1 else None,
        )
        self.down = Linear(
            ckpt,
            f"{name}.down_proj",
            intermediate,
            hidden,
            backend,
            row_parallel_bias(bias, parallel),
            cols=share if parallel.tp_size > 1 else None,
        )
        self.backend = backend
        self.parallel = parallel

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (the whole output on one rank)."""
        return self.down(self.gate_up(x))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.tp_all_reduce(self.partial(x))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_cos_sin(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int, device: torch.device
) -> torch.Tensor:
    """Rotary table ``[max_positions, rotary_dim]``: cos then sin of each frequency.

    Supports the rope types of the architectures pdserve serves: default, linear, llama3
    (Llama 3.1+) and yarn (DeepSeek), following the formulas of the original papers and the
    Hugging Face implementation they are checked against.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    attention_factor = 1.0
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(inv_freq, rotary_dim, theta, scaling)
    elif rope_type != "default":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3, yarn)")
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
    return table.to(device)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    factor = scaling["factor"]
    old_context = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolated = inv_freq / factor
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation, float(attention_factor)
