"""Each ``PDSERVE_*`` environment variable is read in one place, ``pdserve/environment.py``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pdserve import environment

PACKAGE = Path(__file__).resolve().parents[1] / "pdserve"


def _names_pdserve_variable(node: ast.expr) -> bool:
    return any(
        isinstance(part, ast.Constant) and isinstance(part.value, str) and "PDSERVE_" in part.value
        for part in ast.walk(node)
    )


def _environment_reads(tree: ast.AST) -> list[int]:
    """Lines that read a ``PDSERVE_*`` variable: ``os.environ.get``, ``os.environ[...]``, ``os.getenv``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            called = ast.unparse(node.func)
            if called in ("os.environ.get", "os.getenv", "environ.get", "getenv") and _names_pdserve_variable(
                node.args[0]
            ):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if ast.unparse(node.value) in ("os.environ", "environ") and _names_pdserve_variable(node.slice):
                lines.append(node.lineno)
    return lines


def test_pdserve_variables_are_read_only_in_environment_py() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "environment.py" and path.parent == PACKAGE:
            continue
        found += [
            f"{path.relative_to(PACKAGE.parent)}:{line}" for line in _environment_reads(ast.parse(path.read_text()))
        ]
    assert found == [], "read these through pdserve.environment"


def test_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_ETCD", "http://etcd:2379")
    monkeypatch.setenv("PDSERVE_API_KEYS", " a, b,,c ")
    monkeypatch.setenv("PDSERVE_ETCD_USER", "")
    assert environment.etcd_url() == "http://etcd:2379"
    assert environment.api_keys() == ["a", "b", "c"]
    assert environment.etcd_auth_setting("etcd_user") is None  # set but empty: unset
    with pytest.raises(ValueError, match="no etcd setting"):
        environment.etcd_auth_setting("etcd_colour")
