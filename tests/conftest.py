"""Shared fixtures: tiny checkpoints of every architecture, written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils.checkpoints import write_checkpoint


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
