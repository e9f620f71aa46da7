"""What a group across hosts relies on from torch: a TCPStore served at the leader's address
is joined from another host, and gloo's pairs connect across hosts when GLOO_SOCKET_IFNAME
names each rank's interface.

Without it gloo binds the address the hostname resolves to; a host's name that does not
resolve (these hosts', or a machine's own name mapped to 127.0.0.1 in /etc/hosts) falls back
to loopback, so rank 1 is told to connect to 127.0.0.1 and is refused by its own loopback,
while rank 0 waits on past its 10 s group timeout (measured here: rank 1 fails after 10 s,
rank 0 was still waiting at 40 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _start(hosts, ifname: str | None) -> list[subprocess.Popen]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("GLOO_SOCKET_IFNAME", None)
    ranks = []
    for rank, host in enumerate(hosts):
        if ifname is not None:
            env = dict(env, GLOO_SOCKET_IFNAME=ifname)
        argv = [sys.executable, "-m", "tests.distributed.gloo_pair", hosts[0].address, str(rank)]
        ranks.append(
            host.popen(argv, env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return ranks


@pytest.mark.slow
def test_store_and_all_reduce_cross_hosts_on_the_named_interface(two_hosts):
    ranks = _start(two_hosts, two_hosts[0].interface)
    for rank in ranks:
        out, err = rank.communicate(timeout=50)
        assert rank.returncode == 0, err[-2000:]
        assert out.split() == ["3"]


@pytest.mark.slow
def test_without_the_interface_gloo_falls_back_to_loopback_and_fails(two_hosts):
    leader, follower = _start(two_hosts, None)
    _, err = follower.communicate(timeout=50)
    assert follower.returncode != 0
    assert "Connection refused" in err and "127.0.0.1" in err, err[-2000:]
