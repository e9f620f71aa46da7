"""Shared fixtures: tiny checkpoints of every architecture, written once per session; real etcd servers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.utils.checkpoints import write_checkpoint
from tests.utils.etcd_server import EtcdServer


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


@pytest.fixture(scope="session")
def smollm2_reference():
    """transformers running the default model (SmolLM2-135M-Instruct GGUF), loaded once a session."""
    from tests.utils.gguf_files import Reference, default_model

    return Reference(default_model())
