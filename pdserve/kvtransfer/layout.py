"""The KV layout descriptor: what a peer's KV blocks look like, byte for byte.

Two workers may only move KV between them if they agree on every fact that decides where a
value lives in the pool (``KVCacheSpec.shape``) and what its bytes mean. The descriptor is
published with the worker's NIXL metadata and compared by ``check_compatible`` before any
remote agent is loaded, so a mismatch is an error that names the field — never garbled KV.

Tensor-parallel size and rank may differ between the two sides (heterogeneous TP): only the
total number of KV heads must agree, and each side's heads must be a whole number per rank.
"""

from __future__ import annotations

import msgspec
import torch

from pdserve.model.kv_cache import KVCacheSpec

# Bumped whenever the descriptor, the notices or the memory layouts change meaning.
PROTOCOL_VERSION = 1

# Names of the pool layouts ``KVCacheSpec.shape`` produces; part of the descriptor so that a
# future layout (say NHD, or K and V in separate pools) is rejected by older peers.
GQA_MEMORY_LAYOUT = "blocks,layers,kv,heads,tokens,head_dim"
MLA_MEMORY_LAYOUT = "blocks,layers,tokens,latent"


class LayoutMismatch(ValueError):
    """Two layouts that must not exchange KV; ``field`` names the first one that differs."""

    def __init__(self, field: str, local: object, remote: object, detail: str = "") -> None:
        self.field = field
        self.local = local
        self.remote = remote
        message = f"KV layout mismatch on {field!r}: local {local!r}, remote {remote!r}"
        super().__init__(f"{message} ({detail})" if detail else message)


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The KV pool of one tensor-parallel rank, as its peers must see it.

    ``num_kv_heads`` is this rank's share (GQA); the model has ``num_kv_heads * tp_size``.
    For MLA ``num_kv_heads`` and ``head_dim`` are 0 and ``latent_dim`` is
    ``kv_lora_rank + qk_rope_head_dim``; the latent is the same on every rank.
    """

    model: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    block_size: int
    num_layers: int
    is_mla: bool
    num_kv_heads: int
    head_dim: int
    latent_dim: int
    tp_size: int
    tp_rank: int
    memory_layout: str
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if self.block_size < 1 or self.num_layers < 1:
            raise ValueError("block_size and num_layers must be >= 1")
        if self.is_mla and self.latent_dim < 1:
            raise ValueError("an MLA layout needs latent_dim >= 1")
        if not self.is_mla and (self.num_kv_heads < 1 or self.head_dim < 1):
            raise ValueError("a GQA layout needs num_kv_heads >= 1 and head_dim >= 1")

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, model: str, tp_size: int = 1, tp_rank: int = 0) -> KVLayout:
        """The descriptor of a pool built from ``spec`` (one rank's spec) for ``model``."""
        return cls(
            model=model,
            dtype=str(spec.dtype).removeprefix("torch."),
            block_size=spec.block_size,
            num_layers=spec.num_layers,
            is_mla=spec.is_mla,
            num_kv_heads=0 if spec.is_mla else spec.num_kv_heads,
            head_dim=0 if spec.is_mla else spec.head_dim,
            latent_dim=spec.latent_dim if spec.is_mla else 0,
            tp_size=tp_size,
            tp_rank=tp_rank,
            memory_layout=MLA_MEMORY_LAYOUT if spec.is_mla else GQA_MEMORY_LAYOUT,
        )

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def total_kv_heads(self) -> int:
        return self.num_kv_heads * self.tp_size

    @property
    def bytes_per_head_slab(self) -> int:
        """Bytes of one head's K (or V) in one layer of one block: ``[block_size, head_dim]``."""
        return self.block_size * self.head_dim * self.element_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block, all layers: the stride between blocks in the pool."""
        if self.is_mla:
            per_layer = self.block_size * self.latent_dim * self.element_size
        else:
            per_layer = 2 * self.num_kv_heads * self.bytes_per_head_slab
        return self.num_layers * per_layer

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)


# Fields compared for equality, in the order they are reported: the protocol first, since
# when it differs nothing else can be trusted to mean the same thing.
_EQUAL_FIELDS = (
    "protocol_version",
    "memory_layout",
    "model",
    "is_mla",
    "dtype",
    "block_size",
    "num_layers",
    "head_dim",
    "latent_dim",
)


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise ``LayoutMismatch`` unless ``local`` may read KV blocks out of ``remote``.

    TP size and rank may differ; for GQA the total KV heads must match (each rank's share is
    a whole number by construction). KV heads replicated across ranks (more ranks than KV
    heads) are not supported and show up here as a head-count mismatch.
    """
    for field in _EQUAL_FIELDS:
        mine, theirs = getattr(local, field), getattr(remote, field)
        if mine != theirs:
            raise LayoutMismatch(field, mine, theirs)
    if not local.is_mla and local.total_kv_heads != remote.total_kv_heads:
        raise LayoutMismatch(
            "num_kv_heads",
            local.num_kv_heads,
            remote.num_kv_heads,
            f"total KV heads {local.total_kv_heads} at tp_size {local.tp_size} vs "
            f"{remote.total_kv_heads} at tp_size {remote.tp_size}",
        )
