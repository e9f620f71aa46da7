"""Failure paths between real processes: no notice, removed peer, frozen peer, killed peer.

Each ends with the block pools whole: nothing leaks, whatever the peer did.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from tests.kvtransfer import protocol as p
from tests.kvtransfer.conftest import settle, wait_until
from tests.kvtransfer.harness import PeerProcess, start_all

# Big enough that a pull takes a while (64 MiB of 512 KiB blocks), so a peer that dies or
# is removed during a loop of pulls does so mid-transfer.
BIG = dict(num_layers=8, block_size=16, total_kv_heads=8, head_dim=128, num_blocks=160)
BIG_TOKENS = 128 * 16


@pytest.mark.slow
def test_prefill_frees_at_deadline_when_no_notice_comes(gqa):
    P, D = gqa["P1"], gqa["D1"]
    before = P.status()
    start = time.monotonic()
    reply = P.request(p.Hold("no-notice-1", 9, deadline_s=1.0))
    assert isinstance(reply, p.Held)
    wait_until(lambda: P.status().num_held == 0, 5.0, "the hold to expire")
    elapsed = time.monotonic() - start
    assert 0.9 <= elapsed <= 3.0, elapsed
    assert P.status().freed_by_deadline == before.freed_by_deadline + 1
    P.assert_pool_whole()
    # A decode side that shows up after the deadline: its late notice must not free twice.
    result = D.request(p.Pull("no-notice-1", [P.cfg.name], reply.block_ids, 9, keep=False))
    assert isinstance(result, p.PullResult) and result.ok, result
    hold_again = P.request(p.Hold("no-notice-2", 4))  # makes P fetch notices again
    assert isinstance(hold_again, p.Held)
    assert D.request(p.Pull("no-notice-2", [P.cfg.name], hold_again.block_ids, 4, keep=False)).ok
    settle(P, D)
    assert P.status().freed_by_deadline == before.freed_by_deadline + 1


@pytest.fixture(scope="module")
def big() -> Iterator[tuple[PeerProcess, PeerProcess]]:
    prefill, decode = start_all([p.PeerConfig(name="big-P", **BIG), p.PeerConfig(name="big-D", **BIG)])
    try:
        assert decode.add_peer(prefill).ok
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def loop_cmd(prefill: PeerProcess, name: str, deadline_s: float) -> p.PullLoop:
    remote = list(range(0, 2 * 128, 2))[: BIG_TOKENS // 16]  # every other block: no runs
    remote = [b % BIG["num_blocks"] for b in remote]
    template = p.Pull(name, [prefill.cfg.name], remote, BIG_TOKENS, deadline_s=deadline_s)
    return p.PullLoop(template, concurrency=2, max_seconds=20.0)


@pytest.mark.slow
def test_removed_peer_fails_its_transfers_at_once(big):
    P, D = big
    D.send(loop_cmd(P, "removed", deadline_s=10.0))
    time.sleep(0.5)
    removed_at = time.monotonic()
    D.send(p.RemovePeer(P.cfg.name))  # what the registry watcher does when a lease ends
    replies = [D.receive(15.0), D.receive(15.0)]
    elapsed = time.monotonic() - removed_at
    loop = next(r for r in replies if isinstance(r, p.LoopResult))
    assert loop.failure is not None and not loop.failure.ok
    assert elapsed < 3.0, f"failure reported {elapsed:.1f}s after the peer was removed"
    D.assert_pool_whole()
    assert D.add_peer(P).ok  # the peer can come back


@pytest.mark.slow
def test_frozen_prefill_fails_the_pull_at_its_deadline(big):
    P, D = big
    os.kill(P.proc.pid, signal.SIGSTOP)  # alive but answering nothing
    try:
        start = time.monotonic()
        result = D.request(p.Pull("frozen-1", [P.cfg.name], list(range(64)), 64 * 16, deadline_s=1.5), timeout=15)
        elapsed = time.monotonic() - start
    finally:
        os.kill(P.proc.pid, signal.SIGCONT)
    assert isinstance(result, p.PullResult) and not result.ok, result
    assert elapsed < 1.5 + 1.0 + 1.5, f"failure reported after {elapsed:.1f}s"  # deadline + cancel grace
    D.assert_pool_whole()
    P.assert_pool_whole()


@pytest.mark.slow
def test_killed_prefill_mid_transfer_fails_within_the_deadline(big):
    P, D = big
    deadline_s = 3.0
    D.send(loop_cmd(P, "killed", deadline_s=deadline_s))
    time.sleep(0.7)
    killed_at = time.monotonic()
    P.kill()
    reply = D.receive(deadline_s + 10.0)
    elapsed = time.monotonic() - killed_at
    assert isinstance(reply, p.LoopResult) and reply.failure is not None, reply
    assert reply.num_ok >= 1, "the loop should have been transferring when the peer died"
    assert elapsed < deadline_s + 1.0 + 1.5, f"failure reported {elapsed:.1f}s after the kill"
    D.assert_pool_whole()
