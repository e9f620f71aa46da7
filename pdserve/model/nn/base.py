"""The decoder skeleton every supported architecture shares.

embed → N × (norm → attention → norm → MLP or MoE, with residuals) → norm → LM head.
A model file supplies the attention and the feed-forward of each layer.

Decode tokens may join a forward pass under way at a layer boundary (``LateTokens``): they
run the layers they missed on their own, then go on in the batch. A request whose KV lands
while a step runs so gets its next token from that step instead of the one after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.distributed.parallel_state import SINGLE_RANK, ParallelState
from pdserve.kernels.backend import AttentionMetadata, Backend
from pdserve.model.kv_cache import KVCache, KVCacheSpec
from pdserve.model.model_config import ModelConfig
from pdserve.model.nn.layers import RMSNorm
from pdserve.model.nn.tensor_parallel import ParallelLMHead, VocabParallelEmbedding
from pdserve.model.weights import Checkpoint

# (hidden [T, H], positions [T], layer cache, metadata) → [T, H]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
FeedForward = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LateTokens:
    """Decode tokens (one per sequence) that join a forward pass at a layer boundary."""

    input_ids: torch.Tensor  # [J]
    positions: torch.Tensor  # [J]
    meta: AttentionMetadata  # theirs alone: the layers they catch up on
    merged_meta: AttentionMetadata  # the pass's batch with them, from the boundary on
    insert_at: int  # their first row in the batch: right after its decode rows
    sample_rows: torch.Tensor  # the merged batch's rows that sample


# Asked at each layer boundary after the first (the layer's index): tokens that join there, or None.
LateJoin = Callable[[int], "LateTokens | None"]


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
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        late: LateJoin | None = None,
        sample_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every input token; with tokens
        that ``late`` adds, for those too, in the rows of its ``merged_meta``.

        ``sample_rows``: return only these rows ([R, hidden], in that order; with late tokens,
        their ``sample_rows``). The last layer's feed-forward then runs on them alone: every
        layer must still write every token's KV, but no later layer reads the last one's
        output, and a prompt samples from its last token only.
        """
        hidden = self.embed_tokens(input_ids)
        residual = None
        last = len(self.layers) - 1
        for index in range(len(self.layers)):
            joining = late(index) if late is not None and index > 0 else None
            if joining is not None:
                caught_up, caught_up_residual = self._layers(
                    self.embed_tokens(joining.input_ids), None, joining.positions, kv_cache, joining.meta, 0, index
                )
                at = joining.insert_at
                assert residual is not None  # set by layer 0
                hidden = torch.cat([hidden[:at], caught_up, hidden[at:]])
                residual = torch.cat([residual[:at], caught_up_residual, residual[at:]])
                positions = torch.cat([positions[:at], joining.positions, positions[at:]])
                meta = joining.merged_meta
                if sample_rows is not None:
                    sample_rows = joining.sample_rows
            keep = sample_rows if index == last else None
            hidden, residual = self._layers(hidden, residual, positions, kv_cache, meta, index, index + 1, keep)
        return self.norm(hidden, residual)[0]

    def _layers(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        start: int,
        stop: int,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers [start, stop) on the residual stream: (hidden, residual) after the last;
        after the last layer's attention, only the rows ``keep`` when given."""
        for index in range(start, stop):
            layer = self.layers[index]
            normed, residual = layer.input_norm(hidden, residual)
            hidden = layer.attention(normed, positions, kv_cache.layer(index), meta)
            if keep is not None and index == stop - 1:
                hidden, residual = hidden[keep], residual[keep]
            normed, residual = layer.post_attention_norm(hidden, residual)
            hidden = layer.feed_forward(normed)
        assert residual is not None, "a model has layers"
        return hidden, residual

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
