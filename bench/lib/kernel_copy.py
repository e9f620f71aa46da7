"""Another version of a CPU kernel's C file, built on its own, for the kernel benches' ``--against``."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

from pdserve.kernels.cpu.build import load_library


def build_copy(source: Path, current: Path, directory: Path) -> ctypes.CDLL:
    """``source`` built as a copy named like ``current`` in ``directory``, with the headers beside
    ``source``, or ``current``'s where ``source`` has none (an old file saved on its own)."""
    copy = directory / current.name
    shutil.copy(source, copy)
    for header in current.parent.glob("*.h"):
        beside = source.with_name(header.name)
        shutil.copy(beside if beside.is_file() else header, directory)
    return load_library(copy)
