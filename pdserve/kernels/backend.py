"""The compute interface the models run through, and the per-step attention metadata.

Models never call attention or MoE maths directly: they call a ``Backend``. The torch
implementation (``torch_backend.py``) is the reference; the Triton kernels of
``pdserve.kernels`` implement the same methods and are tested against it.

Batches are flat: the step's tokens from all sequences are concatenated (no padding).
Sequences whose query is a single token (decodes) come first, so a backend can run them
as one batched decode and the rest (prefills, chunks, prefix-cache extensions) as extends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from pdserve.kernels.block_fp8 import BlockFP8Weight


@dataclass
class AttentionMetadata:
    """Where each new token's KV goes and what each sequence attends to, for one step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: prefix sums of query lengths
    seq_lens_list: list[int]  # host copies, so reference code needs no device sync
    query_lens_list: list[int]
    num_decodes: int  # leading sequences whose query length is 1
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list, default=0)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_list, default=0)


@dataclass(frozen=True)
class MoERouting:
    """How an MoE layer picks its experts.

    ``scoring`` "softmax" (Mixtral, Qwen-MoE, DeepSeek-V2) or "sigmoid" (DeepSeek-V3).
    With ``num_groups`` > 1, experts are split into groups, the best ``topk_groups`` groups
    are kept (group score: the max expert score with ``group_score`` "max", the sum of the
    top two biased scores with "top2_sum"), and top-k runs within them. A correction bias
    (V3) shifts which experts are chosen but not their weights.
    """

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    scaling_factor: float = 1.0


@dataclass
class DispatchedTokens:
    """Tokens replicated once per chosen expert and grouped by expert."""

    hidden: torch.Tensor  # [num_tokens * top_k, hidden] grouped by expert
    expert_offsets: torch.Tensor  # [num_experts + 1] int64: expert e owns rows offsets[e]:offsets[e+1]
    token_index: torch.Tensor  # [num_tokens * top_k] int64: source token of each row
    weights: torch.Tensor  # [num_tokens * top_k] float32: combine weight of each row


class Backend(ABC):
    """The ops models need. Shapes are given per method; all return new tensors."""

    name: str
    # Whether ``linear`` runs block-FP8 weights (``BlockFP8Weight``) as they are stored. If
    # not, the loader gives ``prepare_weight`` such weights dequantized into the model dtype.
    runs_block_fp8: bool = False
    # Whether the attention ops read a float8_e4m3fn cache (upcasting what they read); the
    # writes get values already scaled and cast by the model (model/nn/kv_quant.py).
    reads_fp8_kv: bool = False

    def prepare_weight(self, weight: torch.Tensor | BlockFP8Weight) -> torch.Tensor | BlockFP8Weight:
        """A linear layer's weight [out, in] in the form ``linear`` reads; by default itself.

        Called once per weight at load time, so a backend may repack it (a copy) for its GEMM.
        A ``BlockFP8Weight`` comes only to a backend that ``runs_block_fp8``.
        """
        return weight

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor | BlockFP8Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x [..., in] · weightᵀ + bias`` → [..., out], ``weight`` as ``prepare_weight`` returned it."""
        # A BlockFP8Weight comes only to a backend that runs_block_fp8, and that one overrides this.
        return F.linear(x, cast(torch.Tensor, weight), bias)

    def prepare_gated_weight(self, weight: torch.Tensor | BlockFP8Weight) -> torch.Tensor | BlockFP8Weight:
        """SwiGLU's gate and up weights stacked [2 · I, in] (gate rows first), in the form
        ``gated_linear`` reads; by default ``prepare_weight``'s."""
        return self.prepare_weight(weight)

    def gated_linear(
        self, x: torch.Tensor, weight: torch.Tensor | BlockFP8Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """SwiGLU's input half: ``silu(gate) * up`` [..., I], where ``gate, up`` are the halves of
        ``x · weightᵀ + bias``, ``weight`` as ``prepare_gated_weight`` returned it."""
        gate, up = self.linear(x, weight, bias).chunk(2, dim=-1)
        return self.silu_mul(gate, up)

    def logits(self, hidden: torch.Tensor, lm_head: torch.Tensor | BlockFP8Weight) -> torch.Tensor:
        """The LM head: float32 logits [R, vocab] of hidden [R, H], ``lm_head`` as ``prepare_weight`` returned it.

        Its own method because its shape is its own: few rows (one per sampled sequence)
        against the widest weight of the model.
        """
        return self.linear(hidden, lm_head).float()

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy sampling's pick: each row's first largest column [R] int64 of logits [R, V]
        (a NaN counting as the largest), as ``torch.argmax``."""
        return logits.argmax(dim=-1)

    @abstractmethod
    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``r = x + residual`` (or ``x``); returns ``(rms_norm(r) * weight, r)``."""

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's activation ``silu(gate) * up`` of gate, up [T, I]."""
        return F.silu(gate) * up

    @abstractmethod
    def rotary(
        self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, interleaved: bool
    ) -> torch.Tensor:
        """Rotate ``x`` [T, H, D] by position; ``cos_sin`` [max_pos, D] holds cos then sin halves.

        ``interleaved`` rotates pairs (2i, 2i+1) (GPT-J/DeepSeek) instead of (i, i + D/2)
        (GPT-NeoX/Llama).
        """

    @abstractmethod
    def write_kv(self, layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] into layer_cache [num_blocks, 2, Hkv, block_size, D]."""

    def rope_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        layer_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """Rotate q and k (GPT-NeoX pairs), store k and v (``write_kv``); returns the rotated q.

        One call, so that a backend can fuse the three (``CpuBackend`` does); q may be rotated
        in place.
        """
        q = self.rotary(q, positions, cos_sin, interleaved=False)
        self.write_kv(layer_cache, self.rotary(k, positions, cos_sin, interleaved=False), v, slot_mapping)
        return q

    @abstractmethod
    def paged_attention(
        self, q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Causal attention of q [T, H, D] over each sequence's cached K/V; returns [T, H, D]."""

    @abstractmethod
    def write_latent(self, layer_cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store MLA latents [T, L] into layer_cache [num_blocks, block_size, L]."""

    @abstractmethod
    def mla_attention(
        self, q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float, v_dim: int
    ) -> torch.Tensor:
        """Absorbed MLA: q [T, H, L] against cached latents [.., L] as keys and their first
        ``v_dim`` values as values (one KV head shared by all heads); returns [T, H, v_dim]."""

    @abstractmethod
    def route(
        self, router_logits: torch.Tensor, config: MoERouting, correction_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick experts: returns (weights [T, top_k] float32, expert ids [T, top_k] int64)."""

    @abstractmethod
    def dispatch(
        self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, num_experts: int
    ) -> DispatchedTokens:
        """Group (token, expert) pairs by expert."""

    @abstractmethod
    def expert_mlp(self, tokens: DispatchedTokens, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """Per-expert SwiGLU: rows of expert e get ``(silu(x W1ᵀ) * x W3ᵀ) W2ᵀ``.

        w13 [E, 2 * I, hidden] stacks W1 (gate) over W3 (up); w2 [E, hidden, I]. Returns
        [rows, hidden] in the dispatched order.
        """

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, tokens: DispatchedTokens, num_tokens: int) -> torch.Tensor:
        """Weighted sum of each token's expert outputs; returns [num_tokens, hidden]."""
