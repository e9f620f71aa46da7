"""Separate "hosts" on one machine: what crosses between machines, crossing a network.

A host is a Linux network namespace with its own IPv4 address on a private subnet (a veth pair
for two hosts, a bridge in a switch namespace for more), its own loopback, and its own mount,
IPC and UTS namespaces held open by one holder process: its ``/dev/shm`` is a tmpfs of its own,
SysV IPC is apart and it has a hostname of its own, so UCX and gloo can reach another host only
through its address, as between machines. Nothing is routed off the machine (no default route,
nothing in the machine's own namespace).

Contract: ``Hosts.__exit__`` — after an exception or a KeyboardInterrupt too — kills every
process started through ``Host.popen``/``Host.run`` (each one's process group), then the
holders, and deletes the namespaces, which takes the veths and the bridge with them; each
tmpfs goes with the last process of its mount namespace. Names start with ``pdh<pid>-``, the
pid of the process that made them; ``Hosts`` removes the leftovers of a pid that is gone.

Needs CAP_SYS_ADMIN and CAP_NET_ADMIN, ``ip netns``, ``unshare`` and ``nsenter``:
``unavailable()`` says why not, for skips. Imports nothing but the standard library.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

_SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
_PREFIX = "pdh"
_NAME = re.compile(rf"^{_PREFIX}(\d+)-")
# The host's side of its link, in its own namespace (GLOO_SOCKET_IFNAME, UCX_NET_DEVICES).
INTERFACE = "veth0"


def _tool(name: str) -> str:
    path = shutil.which(name, path=_SBIN_PATH)
    if path is None:
        raise FileNotFoundError(f"{name} not found on PATH or in /usr/sbin, /sbin")
    return path


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([_tool("ip"), *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


@functools.cache
def unavailable() -> str | None:
    """Why hosts cannot be made here (a skip reason), or None when they can."""
    try:
        for tool in ("ip", "unshare", "nsenter"):
            _tool(tool)
    except FileNotFoundError as exc:
        return str(exc)
    probe = f"{_PREFIX}{os.getpid()}-probe"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode:
        return f"`ip netns add` fails (needs CAP_SYS_ADMIN and CAP_NET_ADMIN): {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(name: str) -> None:
    """Kill every process in a network namespace, then delete it."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    _ip("netns", "del", name, check=False)


def remove_stale() -> list[str]:
    """Delete the namespaces (and their processes) left by a run whose process is gone."""
    names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
    stale = [n for n in names if (m := _NAME.match(n)) and not _pid_alive(int(m.group(1)))]
    for name in stale:
        _kill_namespace(name)
    return stale


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.231.0.0/16 that no address or route of this machine's namespace touches."""
    used = []
    for line in (
        _ip("-4", "route", "show", "table", "all").stdout.splitlines() + _ip("-4", "-o", "addr").stdout.splitlines()
    ):
        for word in line.split():
            try:
                used.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    for third in range(231, 256):
        candidate = ipaddress.ip_network(f"10.231.{third}.0/24")
        if not any(candidate.overlaps(u) for u in used if u.prefixlen > 0):
            return candidate
    raise RuntimeError("no free /24 in 10.231.0.0/16")


@dataclass
class Host:
    """One host: its namespace, address and hostname; commands run inside it."""

    index: int
    namespace: str
    address: str
    hostname: str
    interface: str = INTERFACE
    holder: subprocess.Popen | None = None
    processes: list[subprocess.Popen] = field(default_factory=list)

    def enter_argv(self, cwd: str | None = None) -> list[str]:
        """The argv prefix that runs a command on this host, from this host or another
        (a process started so is not one of ``processes``: its starter owns it)."""
        assert self.holder is not None, "host not started"
        # --wd: entering a mount namespace would otherwise reset the working directory to /.
        enter = [_tool("nsenter"), f"--target={self.holder.pid}", "--net", "--mount", "--ipc", "--uts"]
        return [*enter, f"--wd={cwd or os.getcwd()}"]

    def popen(self, argv: Sequence[str], cwd: str | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` on this host, in its own process group (``subprocess.Popen`` keywords)."""
        proc = subprocess.Popen([*self.enter_argv(cwd), *argv], start_new_session=True, **kwargs)
        self.processes.append(proc)
        return proc

    def run(
        self, argv: Sequence[str], timeout: float = 60, env: dict[str, str] | None = None, cwd: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on this host to its end, its output captured as text; killed after ``timeout``."""
        proc = self.popen(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        finally:
            _kill_group(proc)
            self.processes.remove(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    def stop(self) -> None:
        for proc in self.processes:
            _kill_group(proc)
        self.processes.clear()
        if self.holder is not None:
            _kill_group(self.holder)
            self.holder = None


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


class Hosts:
    """``num_hosts`` hosts, made on enter and removed on exit: ``with Hosts(2) as hosts: hosts[1].popen(...)``."""

    def __init__(self, num_hosts: int = 2) -> None:
        if num_hosts < 2:
            raise ValueError(f"num_hosts must be at least 2, got {num_hosts}")
        self.num_hosts = num_hosts
        self.prefix = f"{_PREFIX}{os.getpid()}-{os.urandom(2).hex()}"
        self.hosts: list[Host] = []
        self.namespaces: list[str] = []

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self):
        return iter(self.hosts)

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _namespace(self, suffix: str) -> str:
        name = f"{self.prefix}-{suffix}"
        _ip("netns", "add", name)
        self.namespaces.append(name)
        return name

    def _make(self) -> None:
        remove_stale()
        subnet = free_subnet()
        names = [self._namespace(f"h{i}") for i in range(self.num_hosts)]
        if self.num_hosts == 2:
            _ip(
                "link",
                "add",
                INTERFACE,
                "netns",
                names[0],
                "type",
                "veth",
                "peer",
                "name",
                INTERFACE,
                "netns",
                names[1],
            )
        else:
            switch = self._namespace("sw")
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for i, name in enumerate(names):
                port = f"p{i}"
                _ip("link", "add", INTERFACE, "netns", name, "type", "veth", "peer", "name", port, "netns", switch)
                _ip("-n", switch, "link", "set", port, "master", "br0")
                _ip("-n", switch, "link", "set", port, "up")
        for i, name in enumerate(names):
            address = str(subnet.network_address + i + 1)
            _ip("-n", name, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", INTERFACE)
            _ip("-n", name, "link", "set", INTERFACE, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            host = Host(i, name, address, hostname=f"{self.prefix}-h{i}")
            host.holder = self._holder(host)
            self.hosts.append(host)

    @staticmethod
    def _holder(host: Host) -> subprocess.Popen:
        """The process that keeps the host's mount, IPC and UTS namespaces (and its /dev/shm) alive."""
        script = f'mount -t tmpfs tmpfs /dev/shm && hostname {host.hostname} && echo "$$" && exec sleep infinity'
        argv = [_tool("ip"), "netns", "exec", host.namespace, _tool("unshare"), "--mount", "--ipc", "--uts"]
        argv += ["--propagation", "private", "sh", "-c", script]
        holder = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
        line = holder.stdout.readline()
        if not line.strip().isdigit() or int(line) != holder.pid:
            _kill_group(holder)
            raise RuntimeError(f"holder of {host.namespace} did not start (said {line!r})")
        return holder

    def close(self) -> None:
        """Kill what runs on the hosts and delete the namespaces; safe to call twice."""
        for host in self.hosts:
            host.stop()
        for name in reversed(self.namespaces):
            _kill_namespace(name)
        self.hosts.clear()
        self.namespaces.clear()
