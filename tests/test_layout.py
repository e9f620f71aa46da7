"""The layout README.md describes is the code's: its Layout list names every package of
``pdserve/`` in dependency order, no module imports a package listed above its own (imports
inside functions count), no two modules import each other even indirectly, and ``tests/``
mirrors the packages."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pdserve"
# Folders of tests/ that mirror no package: shared helpers, whole deployments, bench scripts, the simulator.
TEST_ONLY = {"utils", "e2e", "bench", "sim"}


def _layout_order() -> list[str]:
    """The packages in README's Layout list, top first."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    return re.findall(r"^pdserve/(\w+)/", block, flags=re.M)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every module of pdserve (generated code aside) -> the pdserve modules it imports, anywhere in it."""
    modules = {_module_name(f): f for f in PACKAGE.rglob("*.py") if "v1" not in f.relative_to(PACKAGE).parts[:1]}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from pkg import mod` imports the module when there is one.
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                ]
            else:
                continue
            found |= {t for t in targets if t in modules and t != name}
        graph[name] = found
    return graph


def _package(module: str) -> str | None:
    """The component a module belongs to (None for the top-level leaves and the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


def test_readme_lists_every_package_once():
    order = _layout_order()
    packages = sorted(
        p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists() and p.name != "v1"
    )
    assert sorted(order) == packages
    assert len(order) == len(set(order))


def test_no_package_imports_one_listed_above_it():
    order = _layout_order()
    upward = []
    for module, targets in _imports().items():
        source = _package(module)
        for target in targets:
            dest = _package(target)
            if source and dest and source != dest and order.index(dest) < order.index(source):
                upward.append(f"{module} imports {target}")
    assert not upward, "imports against README's Layout order:\n" + "\n".join(sorted(upward))


def test_top_level_modules_are_leaves():
    """pdserve/*.py (environment, extras, cache, lifecycle) sit below every package."""
    graph = _imports()
    leaves = [m for m in graph if m.count(".") == 1 and _package(m) is None and m != "pdserve.__main__"]
    assert leaves
    for leaf in leaves:
        assert all(_package(t) is None for t in graph[leaf]), f"{leaf} imports {sorted(graph[leaf])}"


def test_no_import_cycle_between_modules():
    graph = _imports()
    # A package's __init__ that only documents its modules imports nothing; one that imports its
    # own submodules is not a cycle with them.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph[module]):
            if module.startswith(target + ".") or target.startswith(module + "."):
                continue
            if state.get(target) == 1:
                cycles.append(" -> ".join(stack[stack.index(target) :] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_tests_mirror_the_packages():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "v1"}
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders - packages <= TEST_ONLY, f"test folders with no package: {sorted(folders - packages - TEST_ONLY)}"


def test_every_package_lists_its_modules():
    """A package's __init__ docstring is its table of contents: each module and subpackage, as ``name``."""
    unlisted = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        folder = init.parent
        if folder.name == "v1":
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        children = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
        children += [p.name for p in folder.iterdir() if (p / "__init__.py").exists()]
        unlisted += [f"{folder.relative_to(ROOT)}: {name}" for name in sorted(children) if f"``{name}``" not in doc]
    assert not unlisted, "modules missing from their package's docstring:\n" + "\n".join(unlisted)
