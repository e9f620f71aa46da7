"""What can be checked of the Dockerfile without a Docker engine: pinned bases, the stages,
a non-root user, the ``pdserve`` entrypoint, and that everything it copies exists."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

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
    assert len(external) == 3
    for image in external:
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest", image
        assert re.match(r"^\d+\.\d+\.\d+", tag), f"{image}: pin an exact version (x.y.z), not {tag!r}"


def test_the_runtime_stages_run_pdserve_as_a_user() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pdserve"] == "pdserve.cli:main"
    found = stages()
    assert {"build", "cpu", "cuda"} <= set(found)
    assert list(found)[-1] == "cuda"  # the default target is the GPU image
    for stage in ("cpu", "cuda"):
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
