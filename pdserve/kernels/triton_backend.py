"""``TritonBackend``: the ``Backend`` interface on pdserve's Triton kernels.

On a CUDA device the kernels are compiled; elsewhere this module selects Triton's interpreter
(``triton_mode.use_interpreter_without_cuda``) before it imports them, and they run on CPU
tensors, slowly but with the same results, which is how the CPU-only tests check them
against ``TorchBackend``.

Attention splits a step as the metadata orders it: the ``num_decodes`` leading one-token
sequences go to the split-K decode kernel, the rest to the extend kernel.
"""

from __future__ import annotations

import torch

from pdserve.kernels.triton_mode import use_interpreter_without_cuda

# Triton decides compiled or interpreted as each @triton.jit function is defined: before the imports below.
use_interpreter_without_cuda()

from pdserve.kernels import kv_write, moe_align, moe_combine, moe_gemm, moe_routing, rms_norm, rotary  # noqa: E402
from pdserve.kernels.backend import AttentionMetadata, Backend, DispatchedTokens, MoERouting  # noqa: E402
from pdserve.kernels.block_fp8 import BlockFP8Weight  # noqa: E402
from pdserve.kernels.block_fp8_gemm import block_fp8_linear  # noqa: E402
from pdserve.kernels.mla_decode import mla_decode_attention  # noqa: E402
from pdserve.kernels.mla_extend import mla_extend_attention  # noqa: E402
from pdserve.kernels.paged_decode import paged_decode_attention  # noqa: E402
from pdserve.kernels.paged_extend import paged_extend_attention  # noqa: E402


class TritonBackend(Backend):
    """Every ``Backend`` op as Triton kernels; results match ``TorchBackend`` within dtype tolerance."""

    name = "triton"
    runs_block_fp8 = True  # FP8 checkpoints' linears stay FP8 and run the block-scaled GEMM

    def linear(self, x, weight, bias=None):
        if isinstance(weight, BlockFP8Weight):
            return block_fp8_linear(x, weight, bias)
        return super().linear(x, weight, bias)

    def rms_norm(self, x, weight, eps, residual=None):
        return rms_norm.rms_norm(x, weight, eps, residual)

    def rotary(self, x, positions, cos_sin, interleaved):
        return rotary.rotary(x, positions, cos_sin, interleaved)

    def write_kv(self, layer_cache, k, v, slot_mapping):
        kv_write.write_kv(layer_cache, k, v, slot_mapping)

    def write_latent(self, layer_cache, latent, slot_mapping):
        kv_write.write_latent(layer_cache, latent, slot_mapping)

    def paged_attention(self, q, layer_cache, meta: AttentionMetadata, scale):
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        nd = meta.num_decodes
        if nd:
            paged_decode_attention(
                q[:nd],
                layer_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                max(meta.seq_lens_list[:nd]),
                scale,
                out[:nd],
            )
        num_extends = meta.num_seqs - nd
        if num_extends:
            paged_extend_attention(
                q,
                layer_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                nd,
                num_extends,
                max(meta.query_lens_list[nd:]),
                scale,
                out,
            )
        return out

    def mla_attention(self, q, layer_cache, meta: AttentionMetadata, scale, v_dim):
        out = q.new_empty(q.shape[0], q.shape[1], v_dim)
        nd = meta.num_decodes
        if nd:
            mla_decode_attention(
                q[:nd],
                layer_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                max(meta.seq_lens_list[:nd]),
                scale,
                v_dim,
                out[:nd],
            )
        num_extends = meta.num_seqs - nd
        if num_extends:
            mla_extend_attention(
                q,
                layer_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                nd,
                num_extends,
                max(meta.query_lens_list[nd:]),
                scale,
                v_dim,
                out,
            )
        return out

    def route(self, router_logits, config: MoERouting, correction_bias):
        return moe_routing.route(router_logits, config, correction_bias)

    def dispatch(self, hidden, weights, expert_ids, num_experts) -> DispatchedTokens:
        return moe_align.dispatch(hidden, weights, expert_ids, num_experts)

    def expert_mlp(self, tokens, w13, w2):
        return moe_gemm.expert_mlp(tokens, w13, w2)

    def combine(self, expert_out, tokens, num_tokens):
        return moe_combine.combine(expert_out, tokens, num_tokens)
