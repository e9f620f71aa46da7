"""Print the requirements pyproject.toml pins, one a line: the project's dependencies, then
those of each extra named on the command line. The Dockerfile installs them in a layer of their
own before pdserve's wheel, so that an edit to pdserve's source reuses that layer.

Usage: ``python3 scripts/requirements.py [EXTRA ...] [--pyproject PATH]``. Standard library only:
it runs on the image's bare Python.
"""

from __future__ import annotations

import argparse
import tomllib


def requirements(project: dict, extras: list[str]) -> list[str]:
    """``project``'s dependencies and those of ``extras``, in order."""
    optional = project.get("optional-dependencies", {})
    return [*project.get("dependencies", []), *(r for extra in extras for r in optional[extra])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("extras", nargs="*", help="extras whose requirements follow the dependencies")
    parser.add_argument("--pyproject", default="pyproject.toml")
    args = parser.parse_args()
    with open(args.pyproject, "rb") as file:
        project = tomllib.load(file)["project"]
    unknown = set(args.extras) - set(project.get("optional-dependencies", {}))
    if unknown:
        parser.error(f"no such extra in {args.pyproject}: {', '.join(sorted(unknown))}")
    print("\n".join(requirements(project, args.extras)))


if __name__ == "__main__":
    main()
