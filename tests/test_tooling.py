"""The repository's static checks, as CI runs them: ``ruff check .``, ``ruff format --check .`` and
``mypy`` (configured in pyproject.toml) must report nothing; a finding fails the test with their
report. ``ruff format .`` is the one formatter: run it before committing."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _check(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{' '.join(args)} reported:\n{result.stdout}{result.stderr}"


def test_ruff_finds_nothing() -> None:
    _check("ruff", "check", ".")


def test_the_tree_is_formatted() -> None:
    _check("ruff", "format", "--check", ".")


@pytest.mark.slow  # a minute or two without mypy's cache (.mypy_cache), seconds with it
def test_mypy_finds_nothing() -> None:
    _check("mypy")
