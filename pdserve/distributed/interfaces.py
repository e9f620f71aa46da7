"""Which network interface holds an address: gloo and NCCL must be told which one to use.

Left to themselves they pick the interface of the hostname's address, which on a machine with
several interfaces (a pod network beside others, a network namespace) can be one the other
ranks cannot reach; a group across hosts names the interface of the address its rank
advertises. Linux only (``SIOCGIFADDR``); elsewhere nothing is found and the libraries choose.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name``, or None (no address, or not Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])


def interface_for(host: str) -> str | None:
    """The interface whose IPv4 address ``host`` is (or resolves to), or None when none here has it."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return None
    if ipaddress.ip_address(address).is_loopback:
        return "lo"
    for _, name in socket.if_nameindex():
        if interface_address(name) == address:
            return name
    return None


def pin_collectives_to(host: str) -> str | None:
    """Make gloo and NCCL (created after this) use the interface of ``host``; the interface, or
    None when ``host`` is no address of this machine's (they choose for themselves then)."""
    name = interface_for(host)
    if name is not None:
        # Read by gloo and NCCL when a process group is created, not by pdserve.
        os.environ["GLOO_SOCKET_IFNAME"] = name
        os.environ["NCCL_SOCKET_IFNAME"] = name
    return name
