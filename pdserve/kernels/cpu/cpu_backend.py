"""``CpuBackend``: the torch reference, with the changes that matter most on a CPU.

- **Attention** runs ``paged_decode.c``, which reads the cache in place; the reference
  copies every block a step reads before computing on it. Decodes always; prompts where the
  head size is 64 or 128 (the kernel's vector paths), 1.5-3x faster than torch's SDPA per
  sequence (bench/RESULTS.md).
- **Linear layers** run ``panel_gemm.c`` on weights packed once at load time into 32-column
  panels: with a decode step's few rows it overlaps the weights' trip from memory with the
  arithmetic: 1.1–1.4× oneDNN's speed from 1 to 128 rows (1.38× at 32), 0.98× at 2048
  (bench/RESULTS.md). SwiGLU's gate and up projections share panels, and their GEMM stores
  ``silu(gate) * up`` itself: the projection is never written out and read back. Without
  AVX-512 they run oneDNN's GEMM on weights repacked into its blocked layout
  (``torch.ops.mkldnn``), which is itself 1.1–3× MKL's on the plain layout.

- **RMSNorm** (with its residual add) and **rotary embedding with the KV cache write** run
  ``layer_ops.c``: one pass each instead of the handful of torch ops (and temporaries) the
  reference spends per layer, which on a decode step of a deep, narrow model cost more than
  the arithmetic.
- **Greedy sampling's argmax** runs ``layer_ops.c``: one vector pass over the logits, about 4x
  torch's on a decode step's 32 x 49,152.
- **Freed activations stay mapped** (``heap.py``), so that a prompt step does not page-fault
  its tens of megabytes of temporaries in again at every layer.

Everything else is the reference. Tensors other than float32 take the reference path: the
kernels are float32 only, which is what CPUs run fast.
"""

from __future__ import annotations

import torch

from pdserve.kernels.backend import AttentionMetadata
from pdserve.kernels.cpu import heap, layer_ops, panel_gemm
from pdserve.kernels.cpu.paged_decode import has_vector_path, load, paged_decode, paged_prefill
from pdserve.kernels.torch_backend import TorchBackend, attend_cached, gather_gqa, mla_gather


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self) -> None:
        load()  # compile now, so that a missing compiler shows at start-up, not mid-request
        layer_ops.load()
        # How float32 weights are prepared: "panels", else "onednn", else kept as they are.
        self.weight_format = "panels" if panel_gemm.available() else "onednn" if _onednn_linear_works() else "plain"
        heap.keep_freed_memory()

    def prepare_weight(self, weight):
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32:
            return weight
        if self.weight_format == "panels":
            return panel_gemm.pack(weight)
        if self.weight_format == "onednn":
            return torch.ops.mkldnn._reorder_linear_weight(weight)
        return weight

    def linear(self, x, weight, bias=None):
        if isinstance(weight, panel_gemm.PanelWeight):
            return panel_gemm.linear(x, weight, bias)
        if weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return super().linear(x, weight, bias)

    def prepare_gated_weight(self, weight):
        if self.weight_format == "panels" and isinstance(weight, torch.Tensor) and weight.dtype == torch.float32:
            return panel_gemm.pack_gated(weight)
        return self.prepare_weight(weight)

    def gated_linear(self, x, weight, bias=None):
        if isinstance(weight, panel_gemm.PanelWeight) and weight.gated:
            return panel_gemm.gated_linear(x, weight, bias)
        return super().gated_linear(x, weight, bias)

    def logits(self, hidden, lm_head):
        if isinstance(lm_head, panel_gemm.PanelWeight) or lm_head.is_mkldnn:
            return self.linear(hidden, lm_head)
        return super().logits(hidden, lm_head)

    def argmax(self, logits):
        if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1 or not logits.shape[1]:
            return super().argmax(logits)
        return layer_ops.argmax(logits)

    def rms_norm(self, x, weight, eps, residual=None):
        if x.dim() != 2 or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.stride(-1) != 1:
            return super().rms_norm(x, weight, eps, residual)
        if residual is not None and (residual.dtype != torch.float32 or residual.stride(-1) != 1):
            return super().rms_norm(x, weight, eps, residual)
        return layer_ops.rms_norm(x, weight.contiguous(), eps, residual)

    def silu_mul(self, gate, up):
        fits = gate.dim() == 2 and gate.dtype == up.dtype == torch.float32 and gate.stride() == up.stride()
        if not fits or (gate.shape[0] and not (gate[0].is_contiguous() and up[0].is_contiguous())):
            return super().silu_mul(gate, up)
        return layer_ops.silu_mul(gate, up)

    def rope_write_kv(self, q, k, v, positions, cos_sin, layer_cache, slot_mapping):
        dim = q.shape[-1]
        fits = (
            _is_float32(q, layer_cache)
            and k.dtype == v.dtype == cos_sin.dtype == torch.float32
            and cos_sin.shape[1] == dim
            and cos_sin.is_contiguous()
            and q.stride()[1:] == (dim, 1)
            and k.stride()[1:] == (dim, 1)
            and v.stride() == k.stride()
            and layer_cache.stride(-1) == 1
        )
        if not fits:
            return super().rope_write_kv(q, k, v, positions, cos_sin, layer_cache, slot_mapping)
        return layer_ops.rope_write_kv(q, k, v, positions, cos_sin, layer_cache, slot_mapping)

    def paged_attention(self, q, layer_cache, meta, scale):
        if not _is_float32(q, layer_cache):
            return super().paged_attention(q, layer_cache, meta, scale)
        keys, values = layer_cache[:, 0], layer_cache[:, 1]  # [num_blocks, Hkv, block_size, D] each
        v_dim = values.shape[-1]
        if meta.num_decodes == meta.num_seqs:  # a step of decodes alone, the common case: nothing to split
            return paged_decode(q, keys, values, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale, v_dim)

        def decode(q_decodes: torch.Tensor) -> torch.Tensor:
            return _decode(q_decodes, keys, values, meta, scale, v_dim)

        if not has_vector_path(q.shape[-1], v_dim, meta.block_size):
            return attend_cached(q, layer_cache, meta, scale, gather_gqa, decode)
        nd = meta.num_decodes
        parts = [decode(q[:nd])] if nd else []
        if nd < meta.num_seqs:  # prompts and chunks, after the decodes' nd rows
            query_start = meta.query_start_loc[nd:] - nd
            parts.append(
                paged_prefill(
                    q[nd:],
                    keys,
                    values,
                    meta.block_tables[nd:],
                    meta.seq_lens[nd:],
                    query_start,
                    max(meta.seq_lens_list[nd:]),
                    scale,
                )
            )
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def mla_attention(self, q, layer_cache, meta, scale, v_dim):
        if not _is_float32(q, layer_cache):
            return super().mla_attention(q, layer_cache, meta, scale, v_dim)
        latents = layer_cache[:, None]  # [num_blocks, 1, block_size, L]: one KV head, keys and values

        def decode(q_decodes: torch.Tensor) -> torch.Tensor:
            return _decode(q_decodes, latents, latents, meta, scale, v_dim)

        return attend_cached(q, layer_cache, meta, scale, mla_gather(v_dim), decode)


def _onednn_linear_works() -> bool:
    """Probe the oneDNN ops once: they are internal to torch, and absent from builds without oneDNN."""
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2))
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), weight, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return bool(out.eq(2).all())


def _is_float32(q: torch.Tensor, layer_cache: torch.Tensor) -> bool:
    return q.dtype == torch.float32 and layer_cache.dtype == torch.float32


def _decode(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: AttentionMetadata, scale: float, v_dim: int
) -> torch.Tensor:
    num_seqs = q.shape[0]
    return paged_decode(
        q,
        keys,
        values,
        meta.block_tables[:num_seqs],
        meta.seq_lens[:num_seqs],
        max(meta.seq_lens_list[:num_seqs]),
        scale,
        v_dim,
    )
