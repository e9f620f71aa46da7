"""Every process of a deployment listens only where it was asked to (``--host``), read from the
kernel's socket tables: the frontend, a single-rank decode worker, and a TP 2 prefill worker with
its rank. The one exception is a group's rendezvous store, which torch binds to every address
(the README's Security section says so): one wildcard listener, in the group's rank 0 alone."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

import pytest

from pdserve.distributed.parallel_config import ParallelConfig
from tests.e2e.deployment import Deployment, rank_children

pytestmark = pytest.mark.slow

_LISTEN, _TABLES = "0A", (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6))


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on."""
    owned = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            owned.add(int(target[8:-1]))
    found = []
    for table, family in _TABLES:
        with open(f"/proc/{pid}/net/{table}") as file:
            rows = file.read().splitlines()[1:]
        for row in rows:
            fields = row.split()
            if fields[3] != _LISTEN or int(fields[9]) not in owned:
                continue
            hex_address, hex_port = fields[1].split(":")
            words = [int(hex_address[i : i + 8], 16) for i in range(0, len(hex_address), 8)]
            packed = b"".join(struct.pack("<I", word) for word in words)
            found.append((socket.inet_ntop(family, packed), int(hex_port, 16)))
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def test_every_listener_is_on_the_host_asked_for_but_a_groups_store(checkpoints, etcd_url):
    path, _ = checkpoints("llama")
    deployment = Deployment(
        str(path),
        etcd_url,
        prefill=1,
        decode=1,
        model_name="listeners",
        disaggregation="always",
        prefill_fields={"parallel": ParallelConfig(tensor_parallel_size=2)},
    )
    try:
        # A pull first: UCX opens its listeners by the time an agent publishes its metadata,
        # and a transfer is what would open any other.
        result = deployment.generate(list(range(3, 20)), max_tokens=4, temperature=0, ignore_eos=True)
        assert result["final"].breakdown.kv_transfer_bytes > 0
        prefill, decode = deployment.worker("prefill").process.pid, deployment.worker("decode").process.pid
        assert deployment.cluster.frontend is not None
        frontend = deployment.cluster.frontend.process.pid
        (rank,) = rank_children([prefill])
        beyond = {pid: [s for s in listening(pid) if not _loopback(s[0])] for pid in (frontend, decode, prefill, rank)}
        assert len(listening(frontend)) >= 3 and listening(decode)  # gRPC, HTTP, metrics; gRPC, metrics, UCX
        assert beyond[frontend] == beyond[decode] == beyond[rank] == [], beyond
        (store,) = beyond[prefill]
        assert store[0] in ("::", "0.0.0.0"), beyond  # the rendezvous store: a wildcard, not an interface
    finally:
        deployment.close()
