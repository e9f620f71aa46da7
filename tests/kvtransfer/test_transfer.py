"""Pulls between real processes over real NIXL/UCX: bytes, prefixes, concurrency, layouts."""

from __future__ import annotations

import random
import time

import pytest
import torch

from tests.kvtransfer import protocol as p
from tests.kvtransfer.checks import assert_blocks, global_pool
from tests.kvtransfer.conftest import GQA, settle, wait_until
from tests.kvtransfer.harness import PeerProcess, start_all
from tests.kvtransfer.peer_main import SENTINEL

TOKENS_PER_BLOCK = GQA["block_size"]


def hold(prefill: PeerProcess, request_id: str, num_tokens: int) -> list[int]:
    reply = prefill.request(p.Hold(request_id, num_tokens))
    assert isinstance(reply, p.Held), reply
    return reply.block_ids


def pull(decode: PeerProcess, cmd: p.Pull) -> p.PullResult:
    reply = decode.request(cmd)
    assert isinstance(reply, p.PullResult), reply
    return reply


def test_gqa_scattered_blocks_are_byte_exact(gqa, tmp_path):
    P, D = gqa["P1"], gqa["D1"]
    remote = hold(P, "exact-1", 37)  # 10 blocks, the last one partial
    assert remote != sorted(remote), "the prefill pool should hand out scattered blocks"
    result = pull(D, p.Pull("exact-1", [P.cfg.name], remote, 37))
    assert result.ok, result.error
    assert result.local_block_ids != sorted(result.local_block_ids)
    stats = result.stats
    assert stats.num_blocks == 10 and stats.num_transfers == 1
    assert stats.num_bytes == 10 * P.cfg.spec().bytes_per_block
    assert 1 <= stats.num_descriptors <= 10 and stats.seconds > 0
    assert_blocks(D.dump(tmp_path / "d.bin"), result.local_block_ids, global_pool(P.cfg), remote)
    D.request(p.Release("exact-1"))
    settle(P, D)
    assert P.status().freed_by_notice >= 1


def test_partial_prefix_on_decode_side_reads_only_missing_blocks(gqa, tmp_path):
    P, D = gqa["P1"], gqa["D1"]
    remote = hold(P, "prefix-1", 10 * TOKENS_PER_BLOCK)
    result = pull(D, p.Pull("prefix-1", [P.cfg.name], remote, 10 * TOKENS_PER_BLOCK, num_cached_blocks=3))
    assert result.ok, result.error
    assert result.stats.num_blocks == 7
    assert result.stats.num_bytes == 7 * P.cfg.spec().bytes_per_block
    pool = D.dump(tmp_path / "d.bin")
    for block in result.local_block_ids[:3]:  # the decode side's own prefix is untouched
        assert bool((pool[block].view(torch.uint8) == SENTINEL).all())
    assert_blocks(pool, result.local_block_ids[3:], global_pool(P.cfg), remote[3:])
    D.request(p.Release("prefix-1"))
    settle(P, D)


def test_full_prefix_hit_moves_nothing_but_still_frees_the_prefill_side(gqa):
    P, D = gqa["P1"], gqa["D1"]
    before = P.status().freed_by_notice
    remote = hold(P, "prefix-all", 4 * TOKENS_PER_BLOCK)
    result = pull(D, p.Pull("prefix-all", [P.cfg.name], remote, 4 * TOKENS_PER_BLOCK, num_cached_blocks=4))
    assert result.ok and result.stats.num_bytes == 0 and result.stats.num_transfers == 0
    wait_until(lambda: P.status().freed_by_notice == before + 1, 5.0, "the notice to free the blocks")
    D.request(p.Release("prefix-all"))
    settle(P, D)


def test_notice_arriving_before_the_hold_is_honoured(gqa):
    """A decode side with the whole prefix cached may answer before the prefill side pins."""
    P, D = gqa["P1"], gqa["D1"]
    before = P.status().freed_by_notice
    result = pull(D, p.Pull("early-1", [P.cfg.name], [0, 1], 2 * TOKENS_PER_BLOCK, num_cached_blocks=2))
    assert result.ok and result.stats.num_bytes == 0
    time.sleep(0.2)  # the notice is queued in NIXL on the prefill side by now
    hold(P, "early-1", 2 * TOKENS_PER_BLOCK)
    wait_until(lambda: P.status().freed_by_notice == before + 1, 5.0, "the early notice to free the hold")
    D.request(p.Release("early-1"))
    settle(P, D)


def test_a_pull_that_gives_up_still_notifies_and_frees_both_sides(gqa):
    P, D = gqa["P1"], gqa["D1"]
    before = P.status().freed_by_notice
    remote = hold(P, "give-up-1", 5 * TOKENS_PER_BLOCK)
    # Two local blocks for five remote ones: the pull refuses (a bad request), frees its
    # blocks, and tells the prefill side it may free — no waiting for the 60 s deadline.
    result = pull(D, p.Pull("give-up-1", [P.cfg.name], remote, 2 * TOKENS_PER_BLOCK))
    assert not result.ok and "bad request" in result.error
    wait_until(lambda: P.status().freed_by_notice == before + 1, 5.0, "the give-up notice")
    settle(P, D)


def test_contiguous_runs_are_coalesced(mla, tmp_path):
    """Runs consecutive on both sides become single descriptors (MLA: whole blocks).

    The MLA decode TP1 peer allocates in pool order, so its blocks are consecutive; the
    remote ids are chosen with runs of 16, 1 and 3 blocks.
    """
    ranks, D = [mla["P2.0"], mla["P2.1"]], mla["D1"]
    for prefill in ranks:
        hold(prefill, "runs-1", 4)
    remote = list(range(100, 116)) + [3] + [7, 8, 9]
    result = pull(D, p.Pull("runs-1", [r.cfg.name for r in ranks], remote, len(remote) * 4))
    assert result.ok, result.error
    local = result.local_block_ids
    assert local == list(range(local[0], local[0] + len(local))), "precondition: in-order decode pool"
    # Runs of 16, 1, 3 → 1 + 1 + 2 descriptors (a run of n is popcount(n) power-of-two pieces).
    assert result.stats.num_descriptors == 4
    # TP1 decode reads MLA from prefill rank 0 only (ranks hold different test data).
    assert_blocks(D.dump(tmp_path / "d.bin"), local, p.prefill_contents(ranks[0].cfg), remote)
    D.request(p.Release("runs-1"))
    settle(*ranks, D)


def test_32_concurrent_transfers(gqa, tmp_path):
    P, D = gqa["P1"], gqa["D1"]
    rng = random.Random(32)
    pulls = []
    for i in range(32):
        num_tokens = rng.randint(1, 6 * TOKENS_PER_BLOCK)
        rid = f"many-{i}"
        pulls.append(p.Pull(rid, [P.cfg.name], hold(P, rid, num_tokens), num_tokens))
    assert P.status().num_held == 32
    reply = D.request(p.PullMany(pulls), timeout=60)
    assert isinstance(reply, p.PullResults)
    pool, expected = D.dump(tmp_path / "d.bin"), global_pool(P.cfg)
    for cmd, result in zip(pulls, reply.results):
        assert result.ok, result.error
        assert_blocks(pool, result.local_block_ids, expected, cmd.remote_block_ids)
        D.request(p.Release(cmd.request_id))
    settle(P, D)


@pytest.mark.slow
def test_layout_mismatch_is_rejected_before_any_byte_moves(gqa, tmp_path):
    P = gqa["P1"]
    (bad,) = start_all([p.PeerConfig(name="bad-D", **{**GQA, "block_size": 8})])
    try:
        reply = bad.add_peer(P)
        assert not reply.ok and reply.field == "block_size", reply
        assert "block_size" in reply.error
        reply = P.request(p.Hold("mismatch-1", 8, deadline_s=1.0))  # nobody will notify
        assert isinstance(reply, p.Held)
        remote = reply.block_ids
        result = pull(bad, p.Pull("mismatch-1", [P.cfg.name], remote, 8))
        assert not result.ok and "unknown" in result.error
        assert not bad.dump(tmp_path / "bad.bin").view(torch.uint8).any(), "bytes moved"
        bad.assert_pool_whole()
    finally:
        bad.stop()
    settle(P)  # freed at its deadline


@pytest.mark.slow
def test_an_fp8_cache_and_a_bfloat16_one_are_refused_before_any_byte_moves(tmp_path):
    """A decode worker on kv_cache_dtype fp8_e4m3 and a prefill worker on bfloat16 hold the
    same blocks in different bytes: the descriptor's dtype refuses the pair. Two peers of its
    own (not the session's six), so it starts quickly on a busy machine."""
    P, fp8 = start_all(
        [
            p.PeerConfig(name="bf16-P", seed=5, **GQA),
            p.PeerConfig(name="fp8-D", **{**GQA, "dtype": "float8_e4m3fn"}),
        ]
    )
    try:
        reply = fp8.add_peer(P)
        assert not reply.ok and reply.field == "dtype", reply
        assert "float8_e4m3fn" in reply.error and "bfloat16" in reply.error
        reply = P.request(p.Hold("fp8-mismatch-1", 8, deadline_s=1.0))  # nobody will notify
        assert isinstance(reply, p.Held)
        result = pull(fp8, p.Pull("fp8-mismatch-1", [P.cfg.name], reply.block_ids, 8))
        assert not result.ok and "unknown" in result.error
        assert not fp8.dump(tmp_path / "fp8.bin").view(torch.uint8).any(), "bytes moved"
        fp8.assert_pool_whole()
        settle(P)  # freed at its deadline
    finally:
        fp8.stop()
        P.stop()
