"""What can be checked of the Dockerfile without a Docker engine: pinned bases, the stages,
a non-root user, the ``pdserve`` entrypoint, that everything it copies exists, that the
operator image's few packages are pyproject.toml's and all that the operator imports, and that
every stage runs on a bare Debian base too (a venv, ``python3``, pip configured by build args),
with the dependencies in layers above pdserve's own wheel. scripts/k8s_image.sh builds it."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).parents[1]


def instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name → its instructions (the global ARGs under "")."""
    found: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    for op, rest in instructions():
        if op == "FROM":
            current = rest.split(" AS ")[-1].strip() if " AS " in rest else rest
            found[current] = [(op, rest)]
        else:
            found[current].append((op, rest))
    return found


def test_every_base_image_is_pinned_to_an_exact_version() -> None:
    defaults = dict(rest.split("=", 1) for op, rest in stages()[""] if op == "ARG" and "=" in rest)
    bases = [rest.split()[0] for op, rest in instructions() if op == "FROM"]
    external = [defaults[b[2:-1]] if b.startswith("${") else b for b in bases if b.strip("${}") not in stages()]
    assert len(external) == 4
    for image in external:
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest", image
        assert re.match(r"^\d+\.\d+\.\d+", tag), f"{image}: pin an exact version (x.y.z), not {tag!r}"


def test_the_runtime_stages_run_pdserve_as_a_user() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pdserve"] == "pdserve.cli:main"
    found = stages()
    assert {"build", "cpu", "operator", "cuda"} <= set(found)
    assert list(found)[-1] == "cuda"  # the default target is the GPU image
    assert json.loads(dict(found["operator"])["CMD"])[0] == "operator"
    for stage in ("cpu", "operator", "cuda"):
        ops = dict(found[stage])
        assert json.loads(ops["ENTRYPOINT"]) == ["pdserve"]
        user = [rest for op, rest in found[stage] if op == "USER"][-1]
        assert user.split(":")[0] not in ("0", "root"), f"{stage} runs as {user}"
        # The operator's pods run as uid 1000 (runAsNonRoot); the image's user must be that one.
        assert user.split(":")[0] == "1000"


def test_what_the_dockerfile_copies_exists() -> None:
    copies = [rest.split() for op, rest in instructions() if op == "COPY" and "--from=" not in rest]
    assert copies
    for args in copies:
        for source in args[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not {"pdserve", "pyproject.toml", "README.md"} & set(ignored)


def operator_requirements() -> list[str]:
    """The requirements the operator stage installs beside pdserve's own wheel (installed --no-deps)."""
    runs = " ".join(rest for op, rest in stages()["operator"] if op == "RUN")
    assert "--no-deps /wheels/" in runs
    return [r for r in re.findall(r'"([^"]+)"', runs) if "$" not in r]


def test_the_operator_image_installs_no_torch_and_pyprojects_pins() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = set(project["dependencies"]) | set(project["optional-dependencies"]["k8s"])
    required = operator_requirements()
    assert {"kopf", "kubernetes"} <= {Requirement(r).name for r in required}
    for requirement in required:
        assert requirement in pinned, (
            f"the operator stage installs {requirement!r}, which pyproject.toml does not pin so"
        )
    assert not {"torch", "nixl", "tokenizers"} & {Requirement(r).name for r in required}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install, by their installed metadata (normalized names)."""
    found: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name = normalized(requirement.name)
        if name in found:
            continue
        found.add(name)
        for line in importlib.metadata.requires(name) or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ["", *requirement.extras]):
                todo.append(sub)
    return found


# Imports the operator's whole path, then runs its command's help, with every installed
# top-level module outside ALLOWED refused as if it were not installed: the operator image.
IMAGE_PYTHON = """
import sys
allowed = set(sys.argv[1].split(","))

class InTheImage:
    def __init__(self, finder):
        self.finder = finder

    def __getattr__(self, name):
        return getattr(self.finder, name)

    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if path is None and top not in allowed and top not in sys.stdlib_module_names and top != "pdserve":
            return None
        return self.finder.find_spec(name, path, target)

sys.meta_path[:] = [InTheImage(finder) for finder in sys.meta_path]
import kopf
from pdserve.cli import main
from pdserve.observability import metrics
from pdserve.operator import handlers, kube, reconcile, removal
sys.exit(main(["operator", "--help"]))
"""


def test_the_operator_image_holds_everything_the_operator_imports() -> None:
    installed = closure(operator_requirements())
    assert "torch" not in installed
    modules = importlib.metadata.packages_distributions()
    allowed = {top for top, dists in modules.items() if {normalized(d) for d in dists} & installed}
    result = subprocess.run(
        [sys.executable, "-c", IMAGE_PYTHON, ",".join(sorted(allowed))], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "usage: pdserve operator" in result.stdout


PIP_ARGS = {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT"}


def test_every_stage_installs_into_the_venv_with_pip_configured_by_build_args() -> None:
    """The stages run on a public Python image or a bare Debian one (python3 alone, externally
    managed): pdserve goes into the venv /opt/pdserve, and a machine's own index reaches pip."""
    for stage in ("build", "cpu", "operator", "cuda"):
        found = stages()[stage]
        assert PIP_ARGS <= {rest.split("=")[0] for op, rest in found if op == "ARG"}, stage
        env = " ".join(rest for op, rest in found if op == "ENV")
        assert "VIRTUAL_ENV=/opt/pdserve" in env and "PATH=/opt/pdserve/bin:$PATH" in env, stage
        runs = [rest for op, rest in found if op == "RUN"]
        assert "python3 -m venv /opt/pdserve" in runs[0], f"{stage}: its first step makes the venv"
        for run in runs:
            assert not re.search(r"(^|[\s&;|(])python\s", run), f"{stage}: `python` is not on a Debian base: {run}"


def test_an_empty_torch_index_url_means_pips_configured_index() -> None:
    cpu = stages()["cpu"]
    assert ("ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu") in cpu
    (torch,) = [rest for op, rest in cpu if op == "RUN" and "torch==" in rest]
    assert '${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}' in torch


def test_dependencies_are_installed_before_pdserves_wheel_is_copied() -> None:
    """An edit to pdserve's source changes the wheel alone: the layers above it stay cached."""
    for stage in ("cpu", "operator", "cuda"):
        found = stages()[stage]
        wheel = found.index(("COPY", "--from=build /wheels /wheels"))
        installs = [i for i, (op, rest) in enumerate(found) if op == "RUN" and "pip install" in rest]
        assert installs[-1] == wheel + 1 and "--no-deps /wheels/*.whl" in found[wheel + 1][1], stage
        assert installs[:-1] and all(i < wheel for i in installs[:-1]), stage
    build = stages()["build"]
    source = build.index(("COPY", "pdserve ./pdserve"))
    requirements = [i for i, (op, rest) in enumerate(build) if op == "RUN" and "requirements.py" in rest]
    assert requirements and requirements[0] < source


def test_the_dependency_layers_install_what_pyproject_pins() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    run = [rest for op, rest in stages()["build"] if op == "RUN" and "requirements.py" in rest][0]
    assert "requirements.py k8s > /requirements/cpu.txt" in run
    assert "requirements.py kernels k8s > /requirements/cuda.txt" in run
    for extras in (["k8s"], ["kernels", "k8s"]):
        printed = subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "requirements.py"),
                *extras,
                "--pyproject",
                str(ROOT / "pyproject.toml"),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        expected = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
        assert printed == expected
