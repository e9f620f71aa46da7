"""RMSNorm with an optionally fused residual add: one program per row.

Rounding follows ``TorchBackend.rms_norm`` step by step — the sum ``x + residual`` is rounded
to the input dtype before it is normalised, and the normalised row is rounded to the input
dtype before the weight multiplies it — so that bf16 results match the reference bit for bit
up to the order of the variance reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.common import cast


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    width,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # Rounded to the input dtype, as the reference's `x + residual` is.
        x = cast(x.to(tl.float32) + res.to(tl.float32), x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / width + eps)
    normed = cast(xf * inv_rms, x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, cast(normed * w, out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual`` (or ``x``); returns ``(rms_norm(r) * weight, r)`` over the last dim.

    The output dtype is the promotion of ``weight`` and ``x`` dtypes, as in the reference.
    ``out`` and ``residual_out`` (contiguous, shaped like ``x``) may be given to write into.
    """
    width = x.shape[-1]
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, width)
    if residual is None:
        res2 = res_out2 = x2  # unused by the kernel
        res_out = x
    else:
        res2 = residual.reshape(-1, width)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = (
            residual_out if residual_out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
        )
        res_out2 = res_out.view(-1, width)
    num_rows = x2.shape[0]
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            x2,
            res2,
            weight.contiguous(),
            out2,
            res_out2,
            x2.stride(0),
            res2.stride(0),
            out2.stride(0),
            res_out2.stride(0),
            width,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(width),
        )
    return out, res_out
