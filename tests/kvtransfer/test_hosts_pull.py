"""A pull between two hosts (``bench.lib.hosts``: network namespaces, each with its own address,
loopback and /dev/shm), as a decode rank pulls from a prefill rank on another machine.

Found here (UCX 1.23 in NIXL 1.5.1): with no UCX_* setting, UCX reaches the other host over
TCP on the host's own interface, and classes the peer "inter-node": no shared-memory or CMA
lane, only ``tcp/veth0``. Within one host it classes the peer "intra-node" and adds
``cma/memory`` to its active-message lanes.
"""

from __future__ import annotations

import re

import pytest

from tests.kvtransfer import protocol as p
from tests.kvtransfer.checks import assert_blocks, global_pool
from tests.kvtransfer.conftest import GQA, settle
from tests.kvtransfer.harness import ROOT, PeerProcess

# UCX's line for an endpoint's configuration: "<agent> inter-node cfg#1 rma_am(tcp/veth0) ...".
LANES = re.compile(r"(\S+) (intra|inter)-node cfg#\d+ (.*)")


@pytest.mark.slow
def test_a_pull_across_hosts_is_byte_exact_over_tcp_on_the_hosts_interface(two_hosts, tmp_path):
    logs = {role: (tmp_path / f"{role}.log").open("w") for role in ("P", "D")}
    env = {"UCX_LOG_LEVEL": "info"}
    cfgs = {
        "P": p.PeerConfig(name="hosts-P", seed=11, **GQA),
        "D": p.PeerConfig(name="hosts-D", scatter_seed=2, **GQA),
    }
    peers = {
        role: PeerProcess(cfgs[role], prefix=host.enter_argv(str(ROOT)), env=env, stderr=logs[role])
        for role, host in zip(("P", "D"), two_hosts)
    }
    try:
        P, D = peers["P"], peers["D"]
        for peer in peers.values():
            peer.wait_ready()
        D.add_peer(P)
        held = P.request(p.Hold("across-1", 37))
        assert isinstance(held, p.Held), held
        result = D.request(p.Pull("across-1", [P.cfg.name], held.block_ids, 37))
        assert isinstance(result, p.PullResult) and result.ok, result
        assert result.stats.num_bytes == 10 * P.cfg.spec().bytes_per_block
        assert_blocks(D.dump(tmp_path / "d.bin"), result.local_block_ids, global_pool(P.cfg), held.block_ids)
        D.request(p.Release("across-1"))
        settle(P, D)
    finally:
        for peer in peers.values():
            peer.stop()
        for log in logs.values():
            log.close()
    lanes = [LANES.search(line) for line in (tmp_path / "D.log").read_text().splitlines()]
    endpoints = [(m.group(2), m.group(3)) for m in lanes if m]
    assert endpoints, "UCX logged no endpoint configuration"
    for where, used in endpoints:
        assert where == "inter", used
        assert set(re.findall(r"\(([^)]*)\)", used)) == {f"tcp/{two_hosts[1].interface}"}, used
