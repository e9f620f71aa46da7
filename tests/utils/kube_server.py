"""A real Kubernetes control plane on loopback for tests: etcd, kube-apiserver and the
kube-controller-manager's garbage collector, deployment, replicaset, statefulset and namespace controllers.

The v1.20.2 binaries are built once per machine by ``scripts/k8s_test_env.sh`` (``scripts/setup.sh``
runs it). Without them the tests that need a server fail with the command to run, never skip.
There is no kubelet: pods stay Pending, and tests make them ready by patching their status.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import yaml
from kubernetes import client as k8s

from tests.utils.etcd_server import EtcdServer

K8S_VERSION = "1.20.2"
CACHE = Path(os.environ.get("PDSERVE_K8S_CACHE", Path.home() / ".cache" / "pdserve" / f"k8s-{K8S_VERSION}"))
START_TIMEOUT_S = 90.0
ADMIN_TOKEN = "pdserve-test-admin"


def k8s_binary(name: str) -> Path:
    """A binary from the cache; a RuntimeError that says how to build it when it is missing."""
    path = CACHE / name
    if not os.access(path, os.X_OK):
        raise RuntimeError(
            f"{path} is missing: build the Kubernetes test binaries with `bash scripts/k8s_test_env.sh` "
            "(about 5 minutes, once per machine)"
        )
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class KubeServer:
    """etcd + kube-apiserver (token auth, RBAC, service-account tokens) + controller-manager."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="pdserve-kube-", dir=root))
        self.port = _free_port()
        self.etcd: EtcdServer | None = None
        self._processes: list[subprocess.Popen] = []
        self.kubeconfig = self.root / "admin.kubeconfig"

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> KubeServer:
        apiserver, manager = k8s_binary("kube-apiserver"), k8s_binary("kube-controller-manager")
        self.etcd = EtcdServer(self.root).start()
        key, pub = self.root / "sa.key", self.root / "sa.pub"
        subprocess.run(["openssl", "genrsa", "-out", key, "2048"], check=True, capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", key, "-pubout", "-out", pub], check=True, capture_output=True)
        tokens = self.root / "tokens.csv"
        tokens.write_text(f'{ADMIN_TOKEN},admin,admin,"system:masters"\n')
        self.write_kubeconfig(self.kubeconfig, ADMIN_TOKEN, "admin")
        self._spawn(
            "kube-apiserver",
            [
                str(apiserver),
                f"--etcd-servers={self.etcd.url}",
                f"--etcd-prefix=/registry-{uuid.uuid4().hex[:8]}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                "--insecure-port=0",
                f"--cert-dir={self.root / 'certs'}",
                f"--token-auth-file={tokens}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={pub}",
                f"--service-account-signing-key-file={key}",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--disable-admission-plugins=ServiceAccount",
                "--enable-priority-and-fairness=false",
                "--profiling=false",
            ],
        )
        self._wait_ready()
        self._spawn(
            "kube-controller-manager",
            [
                str(manager),
                f"--kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--port=0",
                "--secure-port=0",
                "--controllers=garbagecollector,deployment,replicaset,statefulset,namespace",
                "--profiling=false",
                "--concurrent-gc-syncs=5",
            ],
        )
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.log", "wb")
        self._processes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        log.close()

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.root / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def _wait_ready(self) -> None:
        context = ssl._create_unverified_context()  # the server's self-signed certificate
        request = urllib.request.Request(f"{self.url}/readyz", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._processes[0].poll() is not None:
                raise RuntimeError(f"kube-apiserver exited:\n{self.log_tail('kube-apiserver')}")
            try:
                with urllib.request.urlopen(request, context=context, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"kube-apiserver not ready in {START_TIMEOUT_S:g} s:\n{self.log_tail('kube-apiserver')}")

    def write_kubeconfig(self, path: Path, token: str, user: str, namespace: str = "default") -> Path:
        """A kubeconfig for ``token`` (the server's certificate is self-signed: not verified)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url, "insecure-skip-tls-verify": True}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": user, "namespace": namespace}}],
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def configuration(self, token: str = ADMIN_TOKEN) -> k8s.Configuration:
        configuration = k8s.Configuration()
        configuration.host = self.url
        configuration.verify_ssl = False
        configuration.api_key = {"BearerToken": f"Bearer {token}"}  # where load_kube_config puts it
        return configuration

    def close(self) -> None:
        for process in reversed(self._processes):
            process.terminate()
        for process in reversed(self._processes):
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.etcd is not None:
            self.etcd.close()
        shutil.rmtree(self.root, ignore_errors=True)
