"""The cluster DNS of the one-node test cluster (scripts/k8s_cluster.sh): Services and the pods behind headless ones.

A real cluster runs CoreDNS, whose image cannot be had here; the pods of the test cluster
need only what CoreDNS would tell them about Services: ``NAME.NAMESPACE.svc.CLUSTER_DOMAIN``
is the Service's cluster IP, or, for a headless Service, the addresses of its ready
endpoints; and ``HOSTNAME.NAME.NAMESPACE.svc.CLUSTER_DOMAIN`` is the address of each endpoint
that names its pod's hostname (a StatefulSet's pods, whose ``serviceName`` is that headless
Service). Every other name is answered NXDOMAIN at once: nothing on the test cluster may
reach another address, and a fast "no" keeps a resolver's search list from waiting.

Usage: python3 k8s_dns.py ADDRESS KUBECTL KUBECONFIG [CLUSTER_DOMAIN]. It re-reads the
Services and Endpoints every second with kubectl (stdlib only: it runs under the system's
python3) and answers A queries over UDP on ADDRESS:53.
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
import time

TTL_S = 5
REFRESH_S = 1.0
TYPE_A, TYPE_AAAA, CLASS_IN = 1, 28, 1
NOERROR, FORMERR, NXDOMAIN = 0, 1, 3


class Names:
    """name → IPv4 addresses, replaced whole on each refresh (one writer, many readers)."""

    def __init__(self) -> None:
        self.table: dict[str, list[str]] = {}

    def refresh(self, kubectl: str, kubeconfig: str, domain: str) -> None:
        def get(kind: str) -> list[dict]:
            out = subprocess.run(
                [kubectl, f"--kubeconfig={kubeconfig}", "get", kind, "-A", "-o", "json"],
                capture_output=True,
                check=True,
                timeout=10,
            ).stdout
            return json.loads(out)["items"]

        endpoints: dict[tuple[str, str], list[dict]] = {}
        for item in get("endpoints"):
            meta = item["metadata"]
            endpoints[meta["namespace"], meta["name"]] = [
                address for subset in item.get("subsets") or [] for address in subset.get("addresses") or []
            ]
        table: dict[str, list[str]] = {}
        for item in get("services"):
            meta, ip = item["metadata"], item["spec"].get("clusterIP")
            service = f"{meta['name']}.{meta['namespace']}.svc.{domain}"
            if ip not in (None, "", "None"):
                table[service] = [ip]
                continue
            addresses = endpoints.get((meta["namespace"], meta["name"]), [])
            table[service] = [address["ip"] for address in addresses]
            for address in addresses:
                if address.get("hostname"):
                    table[f"{address['hostname']}.{service}"] = [address["ip"]]
        self.table = table


def answer(query: bytes, names: Names) -> bytes:
    """The reply to one DNS query message."""
    if len(query) < 12:
        return b""
    ident, _flags, qdcount = struct.unpack(">HHH", query[:6])
    if qdcount != 1:
        return struct.pack(">HHHHHH", ident, 0x8180 | FORMERR, 0, 0, 0, 0)
    labels, offset = [], 12
    while offset < len(query) and query[offset] != 0:
        length = query[offset]
        labels.append(query[offset + 1 : offset + 1 + length].decode("ascii", "replace").lower())
        offset += 1 + length
    question_end = offset + 5
    if question_end > len(query):
        return struct.pack(">HHHHHH", ident, 0x8180 | FORMERR, 0, 0, 0, 0)
    qtype, qclass = struct.unpack(">HH", query[offset + 1 : question_end])
    question = query[12:question_end]
    addresses = names.table.get(".".join(labels))
    if addresses is None:
        return struct.pack(">HHHHHH", ident, 0x8180 | NXDOMAIN, 1, 0, 0, 0) + question
    records = b""
    if qtype == TYPE_A and qclass == CLASS_IN:
        for address in addresses:
            records += struct.pack(">HHHIH", 0xC00C, TYPE_A, CLASS_IN, TTL_S, 4) + socket.inet_aton(address)
    count = len(addresses) if records else 0
    return struct.pack(">HHHHHH", ident, 0x8180 | NOERROR, 1, count, 0, 0) + question + records


def main() -> None:
    address, kubectl, kubeconfig = sys.argv[1:4]
    domain = sys.argv[4] if len(sys.argv) > 4 else "cluster.local"
    names = Names()

    def keep_fresh() -> None:
        while True:
            try:
                names.refresh(kubectl, kubeconfig, domain)
            except (subprocess.SubprocessError, OSError, ValueError, KeyError) as error:
                print(f"k8s_dns: refresh failed: {error}", file=sys.stderr, flush=True)
            time.sleep(REFRESH_S)

    threading.Thread(target=keep_fresh, daemon=True).start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((address, 53))
    print(f"k8s_dns: answering on {address}:53 for *.svc.{domain}", flush=True)
    while True:
        query, peer = sock.recvfrom(512)
        reply = answer(query, names)
        if reply:
            sock.sendto(reply, peer)


if __name__ == "__main__":
    main()
