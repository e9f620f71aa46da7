"""The decoder skeleton every supported architecture shares.

embed → N × (norm → attention → norm → MLP or MoE, with residuals) → norm → LM head.
A model file supplies the attention and the feed-forward of each layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.distributed import SINGLE_RANK, ParallelState
from pdserve.engine.kv_cache import KVCache, KVCacheSpec
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models.layers import RMSNorm
from pdserve.engine.models.tensor_parallel import ParallelLMHead, VocabParallelEmbedding
from pdserve.engine.weights import Checkpoint
from pdserve.kernels.backend import AttentionMetadata, Backend

# (hidden [T, H], positions [T], layer cache, metadata) → [T, H]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
FeedForward = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class DecoderLayer:
    input_norm: RMSNorm
    attention: Attention
    post_attention_norm: RMSNorm
    feed_forward: FeedForward


class DecoderModel:
    """A causal LM over a flat batch of tokens and a paged KV cache."""

    def __init__(
        self, config: ModelConfig, ckpt: Checkpoint, backend: Backend, parallel: ParallelState = SINGLE_RANK
    ) -> None:
        """``parallel``: this rank's place in its group; each rank builds only its share."""
        self.config = config
        self.backend = backend
        self.parallel = parallel
        hidden = config.hidden_size
        embed_tokens = ckpt.get("model.embed_tokens.weight", (config.vocab_size, hidden))
        self.embed_tokens = VocabParallelEmbedding(embed_tokens, parallel)
        self.layers = [self.build_layer(ckpt, i) for i in range(config.num_layers)]
        self.norm = RMSNorm(ckpt, "model.norm", hidden, config.rms_norm_eps, backend)
        if config.tie_word_embeddings and "lm_head.weight" not in ckpt:
            lm_head = embed_tokens
        else:
            lm_head = ckpt.get("lm_head.weight", (config.vocab_size, hidden))
        self.lm_head = ParallelLMHead(lm_head, parallel, backend)

    def build_layer(self, ckpt: Checkpoint, index: int) -> DecoderLayer:
        c = self.config
        prefix = f"model.layers.{index}"
        return DecoderLayer(
            input_norm=RMSNorm(ckpt, f"{prefix}.input_layernorm", c.hidden_size, c.rms_norm_eps, self.backend),
            attention=self.build_attention(ckpt, f"{prefix}.self_attn"),
            post_attention_norm=RMSNorm(
                ckpt, f"{prefix}.post_attention_layernorm", c.hidden_size, c.rms_norm_eps, self.backend
            ),
            feed_forward=self.build_feed_forward(ckpt, f"{prefix}.mlp", index),
        )

    def build_attention(self, ckpt: Checkpoint, prefix: str) -> Attention:
        raise NotImplementedError

    def build_feed_forward(self, ckpt: Checkpoint, prefix: str, index: int) -> FeedForward:
        """``prefix`` is the layer's ``mlp`` module (architectures naming it otherwise adapt)."""
        raise NotImplementedError

    def kv_cache_spec(self, block_size: int) -> KVCacheSpec:
        raise NotImplementedError

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every input token."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for index, layer in enumerate(self.layers):
            normed, residual = layer.input_norm(hidden, residual)
            hidden = layer.attention(normed, positions, kv_cache.layer(index), meta)
            normed, residual = layer.post_attention_norm(hidden, residual)
            hidden = layer.feed_forward(normed)
        return self.norm(hidden, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [R, vocab] (float32) of hidden [R, hidden]."""
        return self.lm_head(hidden)

    @torch.inference_mode()
    def idle_forward(self) -> None:
        """Take part in a step's collectives without tokens of its own (a data-parallel rank
        whose peers run a batch): every expert-parallel MoE layer exchanges nothing."""
        for layer in self.layers:
            idle = getattr(layer.feed_forward, "idle", None)
            if idle is not None:
                idle()
