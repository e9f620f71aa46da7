"""DeepSeek-V2/V3: multi-head latent attention (MLA) and shared + routed experts.

MLA caches, per token, only the normalised KV latent (``kv_lora_rank`` values) and the
rotated rope key (``qk_rope_head_dim``): 576 values a layer for V3. Attention runs in the
absorbed form: the key up-projection W_UK is folded into the query and the value
up-projection W_UV is applied after attention, so the cache is never expanded per head.
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
from pdserve.model.nn.layers import DenseMLP, Linear, RMSNorm, rope_cos_sin, yarn_mscale
from pdserve.model.nn.moe import MoE
from pdserve.model.nn.tensor_parallel import row_parallel_bias, split
from pdserve.model.weights import Checkpoint


class MLAttention:
    """Multi-head latent attention; with tensor parallelism over this rank's share of the heads
    (the latent, and so the KV cache, is the same on every rank)."""

    def __init__(
        self,
        config: ModelConfig,
        ckpt: Checkpoint,
        prefix: str,
        backend: Backend,
        cos_sin: torch.Tensor,
        parallel: ParallelState,
    ) -> None:
        hidden = config.hidden_size
        heads = split(config.num_heads, parallel, "num_attention_heads")
        self.num_heads = heads.stop - heads.start
        sharded = parallel.tp_size > 1
        self.parallel = parallel
        self.q_lora_rank = config.get("q_lora_rank")
        self.kv_lora_rank = config.require("kv_lora_rank")
        self.nope_dim = config.require("qk_nope_head_dim")
        self.rope_dim = config.require("qk_rope_head_dim")
        self.v_dim = config.require("v_head_dim")
        qk_dim = self.nope_dim + self.rope_dim
        bias = bool(config.get("attention_bias", False))
        q_rows = slice(heads.start * qk_dim, heads.stop * qk_dim) if sharded else None
        if self.q_lora_rank:
            self.q_a_proj = Linear(ckpt, f"{prefix}.q_a_proj", hidden, self.q_lora_rank, backend, bias)
            self.q_a_norm = RMSNorm(ckpt, f"{prefix}.q_a_layernorm", self.q_lora_rank, config.rms_norm_eps, backend)
            self.q_b_proj = Linear(
                ckpt, f"{prefix}.q_b_proj", self.q_lora_rank, config.num_heads * qk_dim, backend, rows=q_rows
            )
        else:
            self.q_proj = Linear(ckpt, f"{prefix}.q_proj", hidden, config.num_heads * qk_dim, backend, rows=q_rows)
        self.kv_a_proj = Linear(
            ckpt, f"{prefix}.kv_a_proj_with_mqa", hidden, self.kv_lora_rank + self.rope_dim, backend, bias
        )
        self.kv_a_norm = RMSNorm(ckpt, f"{prefix}.kv_a_layernorm", self.kv_lora_rank, config.rms_norm_eps, backend)
        kv_b = ckpt.get(
            f"{prefix}.kv_b_proj.weight", (config.num_heads * (self.nope_dim + self.v_dim), self.kv_lora_rank)
        )
        kv_b = kv_b.view(config.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)[heads]
        self.w_uk = kv_b[:, : self.nope_dim].contiguous()  # [H, nope, L]
        self.w_uv = kv_b[:, self.nope_dim :].contiguous()  # [H, v, L]
        self.o_proj = Linear(
            ckpt,
            f"{prefix}.o_proj",
            config.num_heads * self.v_dim,
            hidden,
            backend,
            row_parallel_bias(bias, parallel),
            cols=slice(heads.start * self.v_dim, heads.stop * self.v_dim) if sharded else None,
        )
        self.backend = backend
        self.cos_sin = cos_sin
        self.kv_scale = KVScales.from_checkpoint(ckpt, prefix).k_scale  # the latent's, keys and values alike
        # DeepSeek's v2 and v3 checkpoints store rope dims interleaved (pairs 2i, 2i+1).
        self.interleaved = config.architecture == "DeepseekV2ForCausalLM" or bool(config.get("rope_interleave", True))
        self.scale = qk_dim**-0.5
        scaling = config.rope_scaling or {}
        if scaling.get("mscale_all_dim"):
            self.scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_norm.norm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv_a = self.kv_a_proj(x)
        latent = self.kv_a_norm.norm(kv_a[:, : self.kv_lora_rank])
        k_pe = kv_a[:, self.kv_lora_rank :].unsqueeze(1)  # one rope key shared by all heads
        q_pe = self.backend.rotary(q_pe, positions, self.cos_sin, self.interleaved)
        k_pe = self.backend.rotary(k_pe, positions, self.cos_sin, self.interleaved)
        entry = torch.cat((latent, k_pe.squeeze(1)), dim=-1)
        fp8 = kv_quant.is_fp8(cache)
        self.backend.write_latent(cache, kv_quant.quantize(entry, self.kv_scale) if fp8 else entry, meta.slot_mapping)

        q_latent = torch.einsum("thn,hnl->thl", q_nope, self.w_uk)  # [T, H, L]
        out_latent = self.backend.mla_attention(
            torch.cat((q_latent, q_pe), dim=-1),
            cache,
            meta,
            self.scale * self.kv_scale if fp8 else self.scale,
            self.kv_lora_rank,
        )
        if fp8 and self.kv_scale != 1.0:
            out_latent = out_latent * self.kv_scale
        out = torch.einsum("thl,hvl->thv", out_latent, self.w_uv)  # [T, H, v]
        return self.parallel.tp_all_reduce(self.o_proj(out.flatten(1)))


class DeepseekModel(DecoderModel):
    """DeepSeek-V2 (incl. V2-Lite) and DeepSeek-V3."""

    def __init__(
        self, config: ModelConfig, ckpt: Checkpoint, backend: Backend, parallel: ParallelState = SINGLE_RANK
    ) -> None:
        self.cos_sin = rope_cos_sin(
            config.require("qk_rope_head_dim"),
            config.rope_theta,
            config.rope_scaling,
            config.max_model_len,
            ckpt.device,
        )
        super().__init__(config, ckpt, backend, parallel)

    def kv_cache_spec(self, block_size: int) -> KVCacheSpec:
        c = self.config
        return KVCacheSpec(
            num_layers=c.num_layers,
            block_size=block_size,
            dtype=c.dtype,
            is_mla=True,
            latent_dim=c.require("kv_lora_rank") + c.require("qk_rope_head_dim"),
        )

    def build_attention(self, ckpt: Checkpoint, prefix: str) -> MLAttention:
        return MLAttention(self.config, ckpt, prefix, self.backend, self.cos_sin, self.parallel)

    def build_feed_forward(self, ckpt: Checkpoint, prefix: str, index: int) -> DenseMLP | MoE:
        c = self.config
        is_moe = (
            c.get("n_routed_experts", 0) > 0
            and index >= c.get("first_k_dense_replace", 0)
            and index % c.get("moe_layer_freq", 1) == 0
        )
        if not is_moe:
            return DenseMLP(ckpt, prefix, c.hidden_size, c.intermediate_size, self.backend, parallel=self.parallel)
        moe_intermediate = c.require("moe_intermediate_size")
        num_shared = c.get("n_shared_experts", 0)
        shared = (
            DenseMLP(
                ckpt,
                f"{prefix}.shared_experts",
                c.hidden_size,
                moe_intermediate * num_shared,
                self.backend,
                parallel=self.parallel,
            )
            if num_shared
            else None
        )
        return MoE(
            ckpt,
            self.backend,
            router_name=f"{prefix}.gate.weight",
            expert_names=tuple(f"{prefix}.experts.{{e}}.{w}_proj.weight" for w in ("gate", "up", "down")),
            num_experts=c.require("n_routed_experts"),
            hidden=c.hidden_size,
            intermediate=moe_intermediate,
            router=self._moe_routing(),
            correction_bias_name=f"{prefix}.gate.e_score_correction_bias" if self._is_v3 else None,
            shared=shared,
            parallel=self.parallel,
        )

    @property
    def _is_v3(self) -> bool:
        return self.config.architecture == "DeepseekV3ForCausalLM"

    def _moe_routing(self) -> MoERouting:
        c = self.config
        common = dict(
            top_k=c.require("num_experts_per_tok"),
            renormalize=bool(c.get("norm_topk_prob", self._is_v3)),
            scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        )
        if self._is_v3:
            return MoERouting(
                scoring="sigmoid",
                num_groups=c.get("n_group", 1),
                topk_groups=c.get("topk_group", 1),
                group_score="top2_sum",
                **common,
            )
        if c.get("topk_method", "greedy") == "group_limited_greedy":
            return MoERouting(
                scoring="softmax",
                num_groups=c.require("n_group"),
                topk_groups=c.require("topk_group"),
                group_score="max",
                **common,
            )
        return MoERouting(scoring="softmax", **common)
