"""``bench.lib.hosts``: hosts are apart as machines are — they reach each other only at their
addresses, each has its own loopback and /dev/shm — and nothing is left behind, even after a
failure, an interrupt or a run killed before it could clean up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.lib import hosts as hosts_lib
from bench.lib.hosts import Hosts

pytestmark = pytest.mark.skipif(
    hosts_lib.unavailable() is not None, reason=f"separate hosts unavailable: {hosts_lib.unavailable()}"
)

# Prints "ready" once listening on (argv[1], argv[2]), answers one connection with "pong".
SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
c, _ = s.accept()
c.sendall(b"pong")
"""
# Prints what the server at (argv[1], argv[2]) says, or the error connecting.
CLIENT = """
import socket, sys
try:
    print(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).recv(4).decode())
except OSError as exc:
    print(type(exc).__name__)
"""


def _serve(host: hosts_lib.Host, address: str, port: int) -> subprocess.Popen:
    server = host.popen([sys.executable, "-c", SERVER, address, str(port)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    return server


def _connect(host: hosts_lib.Host, address: str, port: int) -> str:
    done = host.run([sys.executable, "-c", CLIENT, address, str(port)], timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _namespaces() -> set[str]:
    return {line.split()[0] for line in hosts_lib._ip("netns", "list").stdout.splitlines() if line.strip()}


def test_hosts_reach_each_other_at_their_addresses(two_hosts):
    _serve(two_hosts[1], two_hosts[1].address, 7101)
    assert _connect(two_hosts[0], two_hosts[1].address, 7101) == "pong"
    assert two_hosts[0].address != two_hosts[1].address


def test_loopback_is_each_hosts_own(two_hosts):
    _serve(two_hosts[0], "127.0.0.1", 7102)
    assert _connect(two_hosts[1], "127.0.0.1", 7102) == "ConnectionRefusedError"
    assert _connect(two_hosts[0], "127.0.0.1", 7102) == "pong"


def test_dev_shm_is_each_hosts_own(two_hosts):
    name = f"pdserve-hosts-test-{os.getpid()}"
    assert two_hosts[0].run(["touch", f"/dev/shm/{name}"]).returncode == 0
    assert two_hosts[0].run(["ls", "/dev/shm"]).stdout.split() == [name]  # another process, the same host
    assert name not in two_hosts[1].run(["ls", "/dev/shm"]).stdout.split()
    assert not os.path.exists(f"/dev/shm/{name}")  # nor this machine's


def test_each_host_has_its_own_hostname(two_hosts):
    names = [h.run(["hostname"]).stdout.strip() for h in two_hosts]
    assert names == [h.hostname for h in two_hosts] and len(set(names)) == 2


def test_three_hosts_meet_on_a_bridge():
    with Hosts(3) as hosts:
        _serve(hosts[2], hosts[2].address, 7103)
        _serve(hosts[1], hosts[1].address, 7104)
        assert _connect(hosts[0], hosts[2].address, 7103) == "pong"
        assert _connect(hosts[2], hosts[1].address, 7104) == "pong"
        made = {h.namespace for h in hosts} | {f"{hosts.prefix}-sw"}
        assert made <= _namespaces()
    assert not made & _namespaces()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_everything_is_gone_after_exit_even_on_error(error):
    with pytest.raises(error):
        with Hosts(2) as hosts:
            made = {h.namespace for h in hosts}
            holders = [h.holder for h in hosts]
            sleeper = hosts[1].popen(["sleep", "600"])
            assert made <= _namespaces()
            raise error("boom")
    assert not made & _namespaces()
    assert sleeper.returncode is not None and all(h.returncode is not None for h in holders)


def test_a_leftover_of_a_killed_run_is_removed():
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"pdh{gone.pid}-dead-h0"
    hosts_lib._ip("netns", "add", stale)
    squatter = subprocess.Popen([hosts_lib._tool("ip"), "netns", "exec", stale, "sleep", "600"])
    try:
        with Hosts(2):
            assert stale not in _namespaces()
        assert squatter.wait(timeout=10) is not None
    finally:
        squatter.kill()
        hosts_lib._ip("netns", "del", stale, check=False)
