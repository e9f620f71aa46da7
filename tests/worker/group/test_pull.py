"""A decode group's pull, in one process: real NIXL agents (one per rank, each over its own
KV cache), a real GroupLink to a real RankService, a real prefill group of two ranks.

The prefill ranks' caches hold values that name their global head, so each decode rank's cache
shows which heads it read, and from where.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

import pytest
import torch

from pdserve.discovery.registry import Role
from pdserve.kvtransfer import KVAgent, KVLayout, KVPuller, TransferFailed
from pdserve.model.kv_cache import KVCache, KVCacheSpec
from pdserve.worker.group.link import GroupLink
from pdserve.worker.group.pull import GroupPuller
from pdserve.worker.group.rank_service import RankService
from tests.utils.aio import run_scenario

NUM_HEADS = 4  # KV heads of the model
NUM_BLOCKS = 8


def rank_agent(name: str, tp_size: int, tp_rank: int) -> KVAgent:
    spec = KVCacheSpec(
        num_layers=2, block_size=4, dtype=torch.float32, is_mla=False, num_kv_heads=NUM_HEADS // tp_size, head_dim=8
    )
    cache = KVCache(spec, NUM_BLOCKS, torch.device("cpu"))
    return KVAgent(name, cache, KVLayout.from_spec(spec, "m", tp_size=tp_size, tp_rank=tp_rank))


def head_values(agent: KVAgent) -> torch.Tensor:
    """[blocks, layers, kv, heads]: the one value each (block, layer, K/V, head) slab holds."""
    return agent.kv_cache.data[..., 0, 0]


@asynccontextmanager
async def groups(decode_tp: int = 2) -> AsyncIterator[tuple[list[KVAgent], list[KVAgent], GroupPuller]]:
    """A prefill group of 2 ranks, filled: block b, layer l, K/V k, global head h holds
    1000b + 100l + 10k + h; and a decode group of ``decode_tp`` ranks, rank 0's puller linked to
    the others' services."""
    prefill = [rank_agent(f"p.rank{r}", 2, r) for r in range(2)]
    for rank, agent in enumerate(prefill):
        data = agent.kv_cache.data  # [blocks, layers, 2, heads, tokens, head_dim]
        blocks, layers, kv, heads = data.shape[:4]
        for b in range(blocks):
            for layer in range(layers):
                for k in range(kv):
                    for h in range(heads):
                        data[b, layer, k, h] = 1000 * b + 100 * layer + 10 * k + rank * heads + h
    decode = [rank_agent(f"d.rank{r}", decode_tp, r) for r in range(decode_tp)]
    link = GroupLink(decode_tp)
    address = await link.open()
    services = [
        RankService(r, Role.DECODE, decode[r], address, transfer_timeout_s=5.0, connect_timeout_s=10.0)
        for r in range(1, decode_tp)
    ]
    running = [asyncio.ensure_future(service.run()) for service in services]
    for agent in [*prefill, decode[0]]:
        await agent.start()
    try:
        await link.wait_ranks(30.0)
        for peer in prefill:
            await decode[0].add_peer(peer.info)
        yield prefill, decode, GroupPuller(KVPuller(decode[0], deadline_s=5.0), link)
    finally:
        link.closing()
        await link.close()
        await asyncio.gather(*running, return_exceptions=True)
        for agent in [*prefill, decode[0]]:
            await agent.close()


def test_each_decode_rank_reads_exactly_its_heads_and_rank_0_sums_the_bytes():
    async def body() -> None:
        async with groups() as (prefill, decode, puller):
            remote, local = [3, 5, 6], [0, 1, 7]
            stats = await puller.pull("r1", [p.info for p in prefill], remote, local, deadline_s=5.0)
            for rank, agent in enumerate(decode):  # decode rank r holds global heads 2r, 2r+1
                got = head_values(agent)
                for r_block, l_block in zip(remote, local):
                    for layer in range(2):
                        for k in range(2):
                            want = [1000 * r_block + 100 * layer + 10 * k + 2 * rank + h for h in range(2)]
                            assert got[l_block, layer, k].tolist() == want
                assert not got[2:7].any()  # nothing else written
            whole_block = sum(a.layout.bytes_per_block for a in decode)
            assert stats.num_bytes == len(remote) * whole_block

    run_scenario(body(), 120)


def test_one_ranks_failed_pull_fails_the_groups_transfer_naming_the_rank():
    async def body() -> None:
        async with groups() as (prefill, _, puller):
            infos = [p.info for p in prefill]
            await prefill[1].close()  # only decode rank 1 reads from prefill rank 1 (heads 2 and 3)
            with pytest.raises(TransferFailed) as failed:
                await puller.pull("r2", infos, [1, 2], [3, 4], deadline_s=2.0)
            assert failed.value.request_id == "r2"
            assert failed.value.reason.startswith("rank 1: ") and "rank 0" not in failed.value.reason

    run_scenario(body(), 120)
