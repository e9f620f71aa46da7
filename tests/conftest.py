"""Shared fixtures: tiny checkpoints of every architecture, written once per session; real etcd servers
(plain, and with TLS client certificates and auth); separate hosts as network namespaces."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.lib.hosts import Hosts
from bench.lib.hosts import unavailable as hosts_unavailable
from pdserve.discovery.etcd_auth import EtcdAuth
from pdserve.rpc.tls import ClientTLS
from tests.utils.aio import run_scenario
from tests.utils.certs import CertificateAuthority
from tests.utils.checkpoints import write_checkpoint
from tests.utils.etcd_roles import enable_auth
from tests.utils.etcd_server import EtcdServer, EtcdTLS


class CheckpointFactory:
    """Writes each (architecture, dtype) checkpoint once and hands out its path and HF model."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._made: dict[str, tuple[Path, object]] = {}

    def __call__(self, arch: str) -> tuple[Path, object]:
        if arch not in self._made:
            directory = self.root / arch
            directory.mkdir()
            self._made[arch] = (directory, write_checkpoint(directory, arch))
        return self._made[arch]


@pytest.fixture(autouse=True)
def own_state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's ``pdserve up`` records its deployment, and its commands look for one, in a
    state directory of the test's own (made when first used), never the user's."""
    path = tmp_path_factory.getbasetemp() / f"state-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("PDSERVE_STATE_DIR", str(path))
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    return CheckpointFactory(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real etcd shared by the session's tests; they keep apart by unique model names."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    yield server.url
    server.close()


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """A real etcd of the test's own, for tests that stop, restart or wipe it."""
    server = EtcdServer(tmp_path).start()
    yield server
    server.close()


@dataclass(frozen=True)
class SecureEtcd:
    """A real etcd that requires TLS client certificates from ``ca`` and runs etcd's auth with
    the roles of ``tests.utils.etcd_roles`` (README: Security).

    Users: ``operator`` (password ``OPERATOR_PASSWORD``, role pdserve-operator), and, by the
    common name of their client certificates, ``pdserve-worker`` and ``pdserve-frontend``.
    """

    url: str
    ca: CertificateAuthority
    client: ClientTLS  # CN pdserve-operator-tls: a certificate with no etcd user of its name

    def auth(self, common_name: str | None = None, user: str | None = None, password: str | None = None) -> EtcdAuth:
        """Credentials: a client certificate (of ``common_name``, else the anonymous one) and a user."""
        tls = self.client if common_name is None else self.ca.client_tls(common_name)
        return EtcdAuth(tls=tls, user=user, password=password)


OPERATOR_PASSWORD = "operator-pw"


@pytest.fixture(scope="session")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    directory = tmp_path_factory.mktemp("secure-etcd")
    ca = CertificateAuthority(directory, "etcd")
    server_cert = ca.issue("etcd", dns=("localhost",), ips=("127.0.0.1",))
    probe = ca.issue("root")
    server = EtcdServer(
        directory,
        EtcdTLS(cert=server_cert.cert, key=server_cert.key, ca=ca.ca, probe_cert=probe.cert, probe_key=probe.key),
    ).start()
    client = ca.client_tls("pdserve-operator-tls")
    users = {
        "operator": (OPERATOR_PASSWORD, "pdserve-operator"),
        "pdserve-worker": ("unused-w", "pdserve-worker"),
        "pdserve-frontend": ("unused-f", "pdserve-frontend"),
        "pdserve-planner": ("unused-p", "pdserve-planner"),
    }
    host_port = server.url.removeprefix("https://")
    run_scenario(enable_auth(host_port, ClientTLS(ca=ca.ca, cert=probe.cert, key=probe.key), "root-pw", users), 60)
    yield SecureEtcd(url=server.url, ca=ca, client=client)
    server.close()


@pytest.fixture(scope="session")
def smollm2_reference():
    """transformers running the default model (SmolLM2-135M-Instruct GGUF), loaded once a session."""
    from tests.utils.gguf_files import Reference, default_model

    return Reference(default_model())


@pytest.fixture
def two_hosts() -> Iterator[Hosts]:
    """Two separate hosts (network namespaces, each with its own address, loopback and /dev/shm);
    skipped where they cannot be made (not root, no ``ip netns``)."""
    reason = hosts_unavailable()
    if reason is not None:
        pytest.skip(f"separate hosts unavailable: {reason}")
    with Hosts(2) as hosts:
        yield hosts
