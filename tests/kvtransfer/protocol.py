"""Typed messages between a test and its peer processes (JSON lines; never pickle).

Also the deterministic pool contents, so a test can recompute what a prefill rank holds
instead of shipping tensors across the process boundary.
"""

from __future__ import annotations

import msgspec
import torch

from pdserve.kvtransfer.stats import TransferStats
from pdserve.model.kv_cache import KVCacheSpec


class PeerConfig(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    model: str = "tiny"
    dtype: str = "bfloat16"
    num_layers: int = 3
    block_size: int = 4
    is_mla: bool = False
    total_kv_heads: int = 4
    head_dim: int = 8
    latent_dim: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    num_blocks: int = 64
    seed: int | None = None  # fill the pool from this seed (prefill); None: zeros
    hold_deadline_s: float = 60.0
    scatter_seed: int | None = 0  # shuffles the free queue (scattered allocations); None: in order

    def spec(self) -> KVCacheSpec:
        heads = 0 if self.is_mla else self.total_kv_heads // self.tp_size
        return KVCacheSpec(
            num_layers=self.num_layers,
            block_size=self.block_size,
            dtype=getattr(torch, self.dtype),
            is_mla=self.is_mla,
            num_kv_heads=heads,
            head_dim=0 if self.is_mla else self.head_dim,
            latent_dim=self.latent_dim,
        )


def prefill_contents(cfg: PeerConfig) -> torch.Tensor:
    """What prefill rank ``cfg.tp_rank`` holds: a rank's heads of one seeded global pool (GQA),
    or a per-rank seeded latent (MLA; ranks differ so a test can tell which rank was read)."""
    assert cfg.seed is not None
    if cfg.is_mla:
        global_cfg, seed = cfg, cfg.seed + cfg.tp_rank
    else:
        global_cfg, seed = msgspec.structs.replace(cfg, tp_size=1, tp_rank=0), cfg.seed
    shape = global_cfg.spec().shape(cfg.num_blocks)
    dtype = getattr(torch, cfg.dtype)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator).view(dtype).view(shape)
    if cfg.is_mla:
        return pool
    per_rank = cfg.total_kv_heads // cfg.tp_size
    return pool[:, :, :, cfg.tp_rank * per_rank : (cfg.tp_rank + 1) * per_rank].contiguous()


# ---- commands (test → peer) -----------------------------------------------------------------
class AddPeer(msgspec.Struct, tag=True):
    info: bytes


class RemovePeer(msgspec.Struct, tag=True):
    name: str


class Hold(msgspec.Struct, tag=True):
    request_id: str
    num_tokens: int
    deadline_s: float | None = None


class Pull(msgspec.Struct, tag=True):
    request_id: str
    peers: list[str]
    remote_block_ids: list[int]
    num_tokens: int
    num_cached_blocks: int = 0
    deadline_s: float = 10.0
    keep: bool = True  # keep the blocks after success (to dump them); else free at once


class PullMany(msgspec.Struct, tag=True):
    pulls: list[Pull]


class PullLoop(msgspec.Struct, tag=True):
    """Pull ``template`` over and over (``concurrency`` at a time) until one fails."""

    template: Pull
    concurrency: int
    max_seconds: float


class Dump(msgspec.Struct, tag=True):
    path: str


class Release(msgspec.Struct, tag=True):
    request_id: str


class Status(msgspec.Struct, tag=True):
    pass


class Exit(msgspec.Struct, tag=True):
    pass


Command = AddPeer | RemovePeer | Hold | Pull | PullMany | PullLoop | Dump | Release | Status | Exit


# ---- replies (peer → test) ------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True):
    info: bytes


class Done(msgspec.Struct, tag=True):
    ok: bool = True
    error: str | None = None
    field: str | None = None  # LayoutMismatch.field


class Held(msgspec.Struct, tag=True):
    block_ids: list[int]


class PullResult(msgspec.Struct, tag=True):
    request_id: str
    ok: bool
    local_block_ids: list[int]
    error: str | None = None
    stats: TransferStats | None = None


class PullResults(msgspec.Struct, tag=True):
    results: list[PullResult]


class LoopResult(msgspec.Struct, tag=True):
    num_ok: int
    failure: PullResult | None


class PoolStatus(msgspec.Struct, tag=True):
    num_blocks: int
    num_free: int
    integrity_error: str | None
    num_held: int
    freed_by_notice: int  # pins freed by the reporter's "sent"
    freed_by_deadline: int
    num_reported: int  # requests the reporter reported sent (pinned or not yet)


Reply = Ready | Done | Held | PullResult | PullResults | LoopResult | PoolStatus
