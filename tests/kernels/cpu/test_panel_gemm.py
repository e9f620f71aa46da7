"""The panel GEMM against torch's linear: every row count a pass or a chunk of rows can end
on, output widths that end inside a panel, biases, strided and batched inputs. The gated GEMM
against the linear followed by layer_ops' silu_mul, which it must equal bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.cpu import layer_ops, panel_gemm
from tests.kernels.helpers import assert_close

pytestmark = pytest.mark.skipif(not panel_gemm.available(), reason="this CPU has no AVX-512")


@pytest.mark.parametrize("rows", [0, 1, 2, 13, 14, 15, 29, 32, 127, 128, 129, 300])
@pytest.mark.parametrize(("in_features", "out_features"), [(40, 96), (64, 33), (7, 1), (576, 960), (100, 70)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch_linear(rows, in_features, out_features, bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5  # outputs of order 1
    b = torch.randn(out_features, generator=generator) if bias else None
    x = torch.randn(rows, in_features, generator=generator)
    out = panel_gemm.linear(x, panel_gemm.pack(weight), b)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    assert_close(out, F.linear(x, weight, b))


def test_packing_pads_the_last_panel_and_keeps_the_shape():
    weight = torch.randn(70, 12)
    packed = panel_gemm.pack(weight)
    assert packed.panels.shape == (3, 12, 32) and packed.shape == (70, 12)
    assert torch.equal(packed.panels[2, :, :6], weight[64:].t()) and not packed.panels[2, :, 6:].any()


def test_strided_and_batched_inputs():
    weight = torch.randn(48, 40)
    packed = panel_gemm.pack(weight)
    columns = torch.randn(9, 80)[:, 20:60]  # rows 80 apart: a column slice of a fused projection
    assert_close(panel_gemm.linear(columns, packed), F.linear(columns, weight))
    batched = torch.randn(2, 5, 40)
    assert_close(panel_gemm.linear(batched, packed), F.linear(batched, weight))


def test_bad_inputs_name_what_is_wrong():
    packed = panel_gemm.pack(torch.randn(8, 4))
    with pytest.raises(ValueError, match=r"float32 \[\.\.\., 4\]"):
        panel_gemm.linear(torch.randn(2, 5), packed)
    with pytest.raises(ValueError, match="float32"):
        panel_gemm.linear(torch.randn(2, 4).double(), packed)
    with pytest.raises(ValueError, match=r"bias must be float32 \[8\]"):
        panel_gemm.linear(torch.randn(2, 4), packed, torch.randn(7))


@pytest.mark.parametrize("rows", [0, 1, 13, 14, 15, 32, 129, 300])
@pytest.mark.parametrize(("in_features", "intermediate"), [(40, 96), (64, 33), (7, 1), (576, 1536), (100, 70)])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_matches_linear_then_silu_mul(rows, in_features, intermediate, bias):
    generator = torch.Generator().manual_seed(rows * 1000 + intermediate)
    weight = torch.randn(2 * intermediate, in_features, generator=generator) / in_features**0.5
    b = torch.randn(2 * intermediate, generator=generator) if bias else None
    x = torch.randn(rows, in_features, generator=generator)
    out = panel_gemm.gated_linear(x, panel_gemm.pack_gated(weight), b)
    assert out.shape == (rows, intermediate) and out.dtype == torch.float32
    gate, up = panel_gemm.linear(x, panel_gemm.pack(weight), b).chunk(2, dim=-1)
    assert torch.equal(out, layer_ops.silu_mul(gate, up))
    assert_close(
        out,
        F.silu(F.linear(x, weight[:intermediate], b[:intermediate] if bias else None))
        * F.linear(x, weight[intermediate:], b[intermediate:] if bias else None),
    )


def test_gated_packing_pairs_gate_and_up_columns():
    gate, up = torch.randn(20, 6), torch.randn(20, 6)
    packed = panel_gemm.pack_gated(torch.cat((gate, up)))
    assert packed.panels.shape == (2, 6, 32) and packed.shape == (40, 6) and packed.out_features == 20
    assert torch.equal(packed.panels[1, :, :4], gate[16:].t()) and not packed.panels[1, :, 4:16].any()
    assert torch.equal(packed.panels[1, :, 16:20], up[16:].t()) and not packed.panels[1, :, 20:].any()


def test_gated_and_plain_weights_are_not_interchangeable():
    with pytest.raises(ValueError, match="gated_linear"):
        panel_gemm.linear(torch.randn(2, 4), panel_gemm.pack_gated(torch.randn(8, 4)))
    with pytest.raises(ValueError, match="pack_gated"):
        panel_gemm.gated_linear(torch.randn(2, 4), panel_gemm.pack(torch.randn(8, 4)))
    with pytest.raises(ValueError, match="gate and up rows"):
        panel_gemm.pack_gated(torch.randn(7, 4))
    with pytest.raises(ValueError, match=r"bias must be float32 \[8\]"):
        panel_gemm.gated_linear(torch.randn(2, 4), panel_gemm.pack_gated(torch.randn(8, 4)), torch.randn(4))
