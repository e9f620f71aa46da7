"""Llama-family decoders with grouped-query attention.

One file covers the variants, which differ only in details:
- Llama: optional biases (``attention_bias``, ``mlp_bias``); llama3 rope scaling.
- Qwen2: biases on q, k, v (not o).
- Qwen3: per-head RMSNorm on q and k before rope.
- Mixtral, Qwen3-MoE: the MLP is a mixture of experts (softmax top-k).
"""

from __future__ import annotations

import torch

from pdserve.distributed.parallel_state import SINGLE_RANK, ParallelState
from pdserve.kernels.backend import AttentionMetadata, Backend, MoERouting
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.model_config import ModelConfig
from pdserve.model.nn import kv_quant
from pdserve.model.nn.base import DecoderModel
from pdserve.model.nn.kv_quant import KVScales
from pdserve.model.nn.layers import DenseMLP, Linear, MergedLinear, RMSNorm, rope_cos_sin
from pdserve.model.nn.moe import MoE
from pdserve.model.nn.tensor_parallel import head_share, kv_heads_per_rank, row_parallel_bias
from pdserve.model.weights import Checkpoint


class GQAttention:
    """Grouped-query attention; with tensor parallelism, over this rank's share of the heads."""

    def __init__(
        self,
        config: ModelConfig,
        ckpt: Checkpoint,
        prefix: str,
        backend: Backend,
        cos_sin: torch.Tensor,
        parallel: ParallelState,
    ) -> None:
        arch = config.architecture
        hidden, head_dim = config.hidden_size, config.head_dim
        share = head_share(config.num_heads, config.num_kv_heads, parallel)
        self.num_heads, self.num_kv_heads, self.head_dim = share.num_heads, share.num_kv_heads, head_dim
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False))
        o_bias = arch != "Qwen2ForCausalLM" and bool(config.get("attention_bias", False))
        q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
        names = tuple(f"{prefix}.{w}_proj" for w in "qkv")
        q_rows = slice(share.heads.start * head_dim, share.heads.stop * head_dim)
        kv_rows = slice(share.kv_heads.start * head_dim, share.kv_heads.stop * head_dim)
        sharded = parallel.tp_size > 1
        self.qkv_proj = MergedLinear(
            ckpt,
            names,
            hidden,
            (q_size, kv_size, kv_size),
            backend,
            qkv_bias,
            rows=(q_rows, kv_rows, kv_rows) if sharded else None,
        )
        self.o_proj = Linear(
            ckpt,
            f"{prefix}.o_proj",
            q_size,
            hidden,
            backend,
            row_parallel_bias(o_bias, parallel),
            cols=q_rows if sharded else None,
        )
        self.parallel = parallel
        self.qk_norm = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        if self.qk_norm:
            self.q_norm = RMSNorm(ckpt, f"{prefix}.q_norm", head_dim, config.rms_norm_eps, backend)
            self.k_norm = RMSNorm(ckpt, f"{prefix}.k_norm", head_dim, config.rms_norm_eps, backend)
        self.backend = backend
        self.cos_sin = cos_sin
        self.scale = head_dim**-0.5
        self.kv_scales = KVScales.from_checkpoint(ckpt, prefix)

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm.norm(q), self.k_norm.norm(k)
        if not kv_quant.is_fp8(cache):
            q = self.backend.rope_write_kv(q, k, v, positions, self.cos_sin, cache, meta.slot_mapping)
            out = self.backend.paged_attention(q, cache, meta, self.scale)
        else:
            q = self.backend.rotary(q, positions, self.cos_sin, interleaved=False)
            k = self.backend.rotary(k, positions, self.cos_sin, interleaved=False)
            s = self.kv_scales
            self.backend.write_kv(
                cache, kv_quant.quantize(k, s.k_scale), kv_quant.quantize(v, s.v_scale), meta.slot_mapping
            )
            out = self.backend.paged_attention(q, cache, meta, self.scale * s.k_scale)
            if s.v_scale != 1.0:
                out = out * s.v_scale
        return self.parallel.tp_all_reduce(self.o_proj(out.flatten(1)))


class LlamaModel(DecoderModel):
    """Llama, Qwen2, Qwen3, Mixtral and Qwen3-MoE."""

    def __init__(
        self, config: ModelConfig, ckpt: Checkpoint, backend: Backend, parallel: ParallelState = SINGLE_RANK
    ) -> None:
        self.cos_sin = rope_cos_sin(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_model_len, ckpt.device
        )
        super().__init__(config, ckpt, backend, parallel)

    def kv_cache_spec(self, block_size: int) -> KVCacheSpec:
        c = self.config
        return KVCacheSpec(
            num_layers=c.num_layers,
            block_size=block_size,
            dtype=c.dtype,
            is_mla=False,
            num_kv_heads=kv_heads_per_rank(c.num_kv_heads, self.parallel.tp_size),
            head_dim=c.head_dim,
        )

    def build_attention(self, ckpt: Checkpoint, prefix: str) -> GQAttention:
        return GQAttention(self.config, ckpt, prefix, self.backend, self.cos_sin, self.parallel)

    def build_feed_forward(self, ckpt: Checkpoint, prefix: str, index: int) -> DenseMLP | MoE:
        c = self.config
        layer = prefix.removesuffix(".mlp")
        if c.architecture == "MixtralForCausalLM":
            return MoE(
                ckpt,
                self.backend,
                router_name=f"{layer}.block_sparse_moe.gate.weight",
                expert_names=tuple(f"{layer}.block_sparse_moe.experts.{{e}}.{w}.weight" for w in ("w1", "w3", "w2")),
                num_experts=c.require("num_local_experts"),
                hidden=c.hidden_size,
                intermediate=c.intermediate_size,
                router=MoERouting(top_k=c.require("num_experts_per_tok"), renormalize=True),
                parallel=self.parallel,
            )
        if c.architecture == "Qwen3MoeForCausalLM" and self._is_sparse_qwen3_layer(index):
            return MoE(
                ckpt,
                self.backend,
                router_name=f"{prefix}.gate.weight",
                expert_names=tuple(f"{prefix}.experts.{{e}}.{w}_proj.weight" for w in ("gate", "up", "down")),
                num_experts=self._num_qwen3_experts,
                hidden=c.hidden_size,
                intermediate=c.require("moe_intermediate_size"),
                router=MoERouting(
                    top_k=c.require("num_experts_per_tok"), renormalize=bool(c.get("norm_topk_prob", False))
                ),
                parallel=self.parallel,
            )
        return DenseMLP(
            ckpt,
            prefix,
            c.hidden_size,
            c.intermediate_size,
            self.backend,
            bias=bool(c.get("mlp_bias", False)),
            parallel=self.parallel,
        )

    def _is_sparse_qwen3_layer(self, index: int) -> bool:
        c = self.config
        if index in (c.get("mlp_only_layers") or []):
            return False
        return self._num_qwen3_experts > 0 and (index + 1) % c.get("decoder_sparse_step", 1) == 0

    @property
    def _num_qwen3_experts(self) -> int:
        # Hub checkpoints say num_experts; configs written by newer transformers num_local_experts.
        return self.config.get("num_experts") or self.config.get("num_local_experts", 0)
