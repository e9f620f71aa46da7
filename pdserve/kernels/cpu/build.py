"""Compile a kernel's C file once per machine and load it with ``ctypes``.

The shared library is cached under ``$PDSERVE_CACHE_DIR`` (default
``$XDG_CACHE_HOME/pdserve``, else ``~/.cache/pdserve``) in ``cpu_kernels/``, named by a hash
of the source and the headers beside it, the compiler, the flags and the CPU, so that an edit,
a new compiler or a checkout shared between different machines never loads a stale or foreign
build. Processes that start together (a prefill and a decode worker) may both compile; each
writes its own temporary file and renames it into place, so a reader never sees half a
library. A new build replaces the kernel's older ones in the cache.

An image compiles its kernels once with ``prebuild`` into a read-only directory named by
``$PDSERVE_KERNEL_DIR``, looked in first: a pod then loads them instead of compiling (about 9 s
at every start of a CPU pod, whose cache is an empty volume). The name holds the CPU, so a node
whose CPU differs from the build machine's compiles its own into the cache as before.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdserve import environment
from pdserve.cache import cache_root

# -march=native: the library is built on the machine that runs it (the cache key holds the
# CPU's flags). -fassociative-math lets reductions vectorize; the kernels' exp uses fmaf
# so that reassociation cannot change it. No -ffast-math: infinities and NaN must behave.
FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fopenmp",
    "-fPIC",
    "-shared",
)
COMPILE_TIMEOUT_S = 120.0


class CpuKernelsUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded here; the message says why and what to do."""


def cache_dir() -> Path:
    return cache_root() / "cpu_kernels"


@functools.cache
def load_library(source: Path) -> ctypes.CDLL:
    """The compiled ``source``, built now if no cached build matches; raises ``CpuKernelsUnavailable``."""
    compiler = _compiler()
    name = _library_name(compiler, source)
    prebuilt = environment.kernel_dir()
    library = Path(prebuilt) / name if prebuilt else None
    if library is None or not library.is_file():
        library = cache_dir() / name
        if not library.is_file():
            _compile(compiler, source, library.parent, library)
    try:
        return ctypes.CDLL(str(library))
    except OSError as exc:
        raise CpuKernelsUnavailable(f"cannot load the compiled kernel {library}: {exc}") from exc


def prebuild(directory: Path, sources: list[Path] | None = None) -> list[Path]:
    """Compile ``sources`` (default: every kernel of this package) into ``directory``, for
    ``$PDSERVE_KERNEL_DIR``; returns the libraries. Raises ``CpuKernelsUnavailable``."""
    compiler = _compiler()
    built = []
    for source in sources if sources is not None else sorted(Path(__file__).parent.glob("*.c")):
        library = directory / _library_name(compiler, source)
        _compile(compiler, source, directory, library)
        built.append(library)
    return built


def _library_name(compiler: str, source: Path) -> str:
    # The headers beside it (shared math) are part of what is built: an edit to one is a new build.
    code = b"\0".join(path.read_bytes() for path in [source, *sorted(source.parent.glob("*.h"))])
    key = hashlib.sha256(
        b"\0".join([code, " ".join(FLAGS).encode(), _compiler_version(compiler).encode(), _cpu_signature().encode()])
    ).hexdigest()[:16]
    return f"{source.stem}-{key}.so"


def _compiler() -> str:
    for candidate in (os.environ.get("CC"), "cc", "gcc"):
        if candidate and (path := shutil.which(candidate)):
            return path
    raise CpuKernelsUnavailable("no C compiler found (install gcc, or set CC to one)")


def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CpuKernelsUnavailable(f"the C compiler {compiler} does not run: {exc}") from exc
    return done.stdout.strip()


def _cpu_signature() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def _compile(compiler: str, source: Path, directory: Path, library: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=f".{library.stem}.", suffix=".so", dir=directory)
        os.close(fd)
    except OSError as exc:
        raise CpuKernelsUnavailable(
            f"cannot write the kernel cache {directory}: {exc} (set PDSERVE_CACHE_DIR to a writable directory)"
        ) from exc
    command = [compiler, *FLAGS, "-o", partial, str(source), "-lm"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise CpuKernelsUnavailable(
                f"compiling {source.name} failed ({' '.join(command)}):\n{done.stderr.strip()[-2000:]}"
            )
        os.replace(partial, library)
        _remove_other_builds(library, source.stem)
    except subprocess.TimeoutExpired as exc:
        raise CpuKernelsUnavailable(f"compiling {source.name} took over {COMPILE_TIMEOUT_S:.0f} s") from exc
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _remove_other_builds(library: Path, stem: str) -> None:
    # One build per kernel stays cached: an edit or a new compiler would otherwise leave its
    # old build behind forever. A process still running an older build keeps its mapping;
    # one that alternates between two builds recompiles, which takes about a second.
    for other in library.parent.glob(f"{stem}-*.so"):
        if other != library:
            other.unlink(missing_ok=True)
