"""pdserve's per-user cache directory: compiled CPU kernels, the default model.

``$PDSERVE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/pdserve``, else ``~/.cache/pdserve``
(a per-user temporary directory where there is no home, as in some containers).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pdserve import environment


def cache_root() -> Path:
    """The cache directory (not created here)."""
    root = environment.cache_dir()
    if root:
        return Path(root)
    base: str | Path | None = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = Path.home() / ".cache"
        except RuntimeError:  # no home directory (some containers): a per-user temporary one
            base = Path(tempfile.gettempdir()) / f"pdserve-{os.getuid()}"
    return Path(base) / "pdserve"
