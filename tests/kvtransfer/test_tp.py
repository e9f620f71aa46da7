"""Heterogeneous tensor parallelism between real processes: each decode rank reads exactly
its heads (GQA), or whole blocks from one prefill rank (MLA); every prefill rank frees."""

from __future__ import annotations

import pytest

from tests.kvtransfer import protocol as p
from tests.kvtransfer.checks import assert_blocks, global_pool, heads_of
from tests.kvtransfer.conftest import settle, wait_until
from tests.kvtransfer.harness import PeerProcess

GROUPS = {1: ["P1"], 2: ["P2.0", "P2.1"]}
DECODE = {1: ["D1"], 2: ["D2.0", "D2.1"]}


def hold_group(prefills: list[PeerProcess], request_id: str, num_tokens: int) -> list[int]:
    """Every prefill rank pins the request; TP ranks share one block table."""
    tables = []
    for prefill in prefills:
        reply = prefill.request(p.Hold(request_id, num_tokens))
        assert isinstance(reply, p.Held), reply
        tables.append(reply.block_ids)
    assert all(t == tables[0] for t in tables), "TP ranks must allocate identical block tables"
    return tables[0]


def pull_group(decodes: list[PeerProcess], prefills: list[PeerProcess], request_id: str, remote, num_tokens):
    """Every decode rank pulls concurrently (as a TP group would)."""
    cmd = p.Pull(request_id, [q.cfg.name for q in prefills], remote, num_tokens)
    for decode in decodes:
        decode.send(cmd)
    results = []
    for decode in decodes:
        reply = decode.receive(30.0)
        assert isinstance(reply, p.PullResult) and reply.ok, reply
        results.append(reply)
    return results


@pytest.mark.parametrize("p_size,d_size", [(1, 2), (2, 1), (2, 2)], ids=["tp1to2", "tp2to1", "tp2to2"])
def test_gqa_heterogeneous_tp_reads_exactly_each_ranks_heads(gqa, tmp_path, p_size, d_size):
    prefills = [gqa[n] for n in GROUPS[p_size]]
    decodes = [gqa[n] for n in DECODE[d_size]]
    rid = f"tp-{p_size}-{d_size}"
    before = [q.status().freed_by_notice for q in prefills]
    remote = hold_group(prefills, rid, 23)  # 6 blocks, scattered
    results = pull_group(decodes, prefills, rid, remote, 23)
    expected = global_pool(prefills[0].cfg)  # [blocks, layers, 2, all heads, tokens, dim]
    spec = prefills[0].cfg.spec()
    for rank, (decode, result) in enumerate(zip(decodes, results)):
        pool = decode.dump(tmp_path / f"d{rank}.bin")
        assert pool.shape[3] == 4 // d_size
        assert_blocks(pool, result.local_block_ids, heads_of(expected, rank, d_size).contiguous(), remote)
        stats = result.stats
        assert stats.num_transfers == max(1, p_size // d_size)  # one READ per source rank
        assert stats.num_bytes == len(remote) * decode.cfg.spec().bytes_per_block
        if p_size == d_size:  # whole blocks: at most one descriptor per block
            assert stats.num_descriptors <= len(remote)
        else:  # per (block, layer, K/V) head slices
            assert stats.num_descriptors == len(remote) * 2 * spec.num_layers * stats.num_transfers
        decode.request(p.Release(rid))
    for q, n in zip(prefills, before):  # every prefill rank was freed by notices, not deadline
        wait_until(lambda: q.status().freed_by_notice == n + 1, 5.0, f"{q.cfg.name} notified")
    settle(*prefills, *decodes)


@pytest.mark.slow
@pytest.mark.parametrize("d_size", [1, 2], ids=["tp2to1", "tp2to2"])
def test_mla_reads_one_prefill_rank_and_every_rank_frees(mla, tmp_path, d_size):
    prefills = [mla["P2.0"], mla["P2.1"]]
    decodes = [mla[n] for n in DECODE[d_size]]
    rid = f"mla-tp-{d_size}"
    before = [q.status().freed_by_notice for q in prefills]
    remote = hold_group(prefills, rid, 30)
    results = pull_group(decodes, prefills, rid, remote, 30)
    for rank, (decode, result) in enumerate(zip(decodes, results)):
        # The test gives each prefill rank different latent bytes, so this proves which
        # single rank was read: decode rank r reads prefill rank r % p.
        source = prefills[rank % 2]
        assert result.stats.num_transfers == 1
        assert_blocks(
            decode.dump(tmp_path / f"m{rank}.bin"), result.local_block_ids, p.prefill_contents(source.cfg), remote
        )
        decode.request(p.Release(rid))
    for q, n in zip(prefills, before):
        wait_until(lambda: q.status().freed_by_notice == n + 1, 5.0, f"{q.cfg.name} notified")
    settle(*prefills, *decodes)
