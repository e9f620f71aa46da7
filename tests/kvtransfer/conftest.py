"""Peer processes shared by the kvtransfer tests (start-up dominates their run time).

Every group is started once per session and stopped at the end; each test uses its own
request ids and ends by checking that every pool it touched is whole again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from tests.kvtransfer import protocol as p
from tests.kvtransfer.harness import PeerProcess, start_all


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def settle(*peers: PeerProcess, timeout: float = 10.0) -> None:
    """Wait until no prefill peer holds blocks, then assert every pool is whole."""
    for peer in peers:
        wait_until(lambda: peer.status().num_held == 0, timeout, f"{peer.cfg.name} to release its holds")
        peer.assert_pool_whole()


GQA = dict(num_layers=3, block_size=4, total_kv_heads=4, head_dim=8, num_blocks=256)
MLA = dict(is_mla=True, num_layers=3, block_size=4, latent_dim=12, num_blocks=256)


@pytest.fixture(scope="session")
def gqa() -> Iterator[dict[str, PeerProcess]]:
    """Prefill TP1 "P1", prefill TP2 "P2.0"/"P2.1", decode TP1 "D1", decode TP2 "D2.0"/"D2.1"."""
    cfgs = [
        p.PeerConfig(name="gqa-P1", seed=11, **GQA),
        p.PeerConfig(name="gqa-P2.0", seed=11, tp_size=2, tp_rank=0, scatter_seed=1, **GQA),
        p.PeerConfig(name="gqa-P2.1", seed=11, tp_size=2, tp_rank=1, scatter_seed=1, **GQA),
        p.PeerConfig(name="gqa-D1", scatter_seed=2, **GQA),
        p.PeerConfig(name="gqa-D2.0", tp_size=2, tp_rank=0, scatter_seed=3, **GQA),
        p.PeerConfig(name="gqa-D2.1", tp_size=2, tp_rank=1, scatter_seed=4, **GQA),
    ]
    peers = start_all(cfgs)
    by_name = {peer.cfg.name.removeprefix("gqa-"): peer for peer in peers}
    try:
        for d in ("D1", "D2.0", "D2.1"):
            for q in ("P1", "P2.0", "P2.1"):
                assert by_name[d].add_peer(by_name[q]).ok
        yield by_name
    finally:
        for peer in peers:
            peer.stop()


@pytest.fixture(scope="session")
def mla() -> Iterator[dict[str, PeerProcess]]:
    """MLA prefill TP2 "P2.0"/"P2.1", decode TP1 "D1" and TP2 "D2.0"/"D2.1"."""
    cfgs = [
        p.PeerConfig(name="mla-P2.0", seed=21, tp_size=2, tp_rank=0, scatter_seed=5, **MLA),
        p.PeerConfig(name="mla-P2.1", seed=21, tp_size=2, tp_rank=1, scatter_seed=5, **MLA),
        p.PeerConfig(name="mla-D1", scatter_seed=None, **MLA),  # in order: coalescing test
        p.PeerConfig(name="mla-D2.0", tp_size=2, tp_rank=0, scatter_seed=7, **MLA),
        p.PeerConfig(name="mla-D2.1", tp_size=2, tp_rank=1, scatter_seed=8, **MLA),
    ]
    peers = start_all(cfgs)
    by_name = {peer.cfg.name.removeprefix("mla-"): peer for peer in peers}
    try:
        for d in ("D1", "D2.0", "D2.1"):
            for q in ("P2.0", "P2.1"):
                assert by_name[d].add_peer(by_name[q]).ok
        yield by_name
    finally:
        for peer in peers:
            peer.stop()
