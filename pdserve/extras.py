"""pdserve's optional extras: a package of one that is missing becomes an error naming the install command.

The core install serves (engine, workers, frontend, registry, NIXL); the ``k8s`` extra adds
kopf and kubernetes, which only the operator and the planner's Kubernetes connector import.
Code that imports an extra's package catches ``ModuleNotFoundError`` and calls
``missing_extra``, which raises ``MissingExtra`` when the missing module is one of that extra's
packages and re-raises the original error otherwise (a broken install is not a missing extra).
Imports the standard library only.
"""

from __future__ import annotations

from typing import NoReturn

# extra → the top-level modules it installs.
EXTRAS: dict[str, tuple[str, ...]] = {"k8s": ("kopf", "kubernetes")}


class MissingExtra(ModuleNotFoundError):
    """A package of one of pdserve's extras is not installed; the message names the pip command."""


def install_command(extra: str) -> str:
    return f"pip install 'pdserve[{extra}]'"


def missing_extra(error: ModuleNotFoundError, extra: str, what: str) -> NoReturn:
    """Raise ``MissingExtra`` for ``error`` if it is about one of ``extra``'s packages, else ``error``.

    ``what`` names the part that needs the extra ("pdserve operator").
    """
    module = (error.name or "").split(".")[0]
    if module not in EXTRAS[extra]:
        raise error
    raise MissingExtra(
        f"{what} needs the {module!r} package, in pdserve's {extra} extra: {install_command(extra)}", name=error.name
    ) from error
