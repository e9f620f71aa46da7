"""One description of the machine a bench ran on: the ``machine`` field of every report.

Contract: ``describe()`` never fails for a source it cannot read (that field is None): the CPU
model and its vector-ISA flags come from ``lscpu``, else ``/proc/cpuinfo``; memory from
``/proc/meminfo``. Importing this module imports nothing but the standard library (torch is
imported by ``describe``), so a child running under another environment may import it.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

# The flags that decide which kernels run: vector and matrix extensions.
_ISA_PREFIXES = ("avx", "amx", "fma", "f16c")


def _lscpu() -> dict[str, str]:
    try:
        done = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, env={**os.environ, "LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = {}
    for line in done.stdout.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def _proc_fields(path: str) -> dict[str, str]:
    try:
        text = Path(path).read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's model name and its vector-ISA flags (avx*, amx*, fma, f16c), sorted."""
    lscpu = _lscpu()
    cpuinfo = {} if "Model name" in lscpu and "Flags" in lscpu else _proc_fields("/proc/cpuinfo")
    model = lscpu.get("Model name") or cpuinfo.get("model name") or platform.processor() or "unknown"
    flags = (lscpu.get("Flags") or cpuinfo.get("flags") or "").split()
    return model, sorted(f for f in flags if f.startswith(_ISA_PREFIXES))


def ram_gib() -> float | None:
    total = _proc_fields("/proc/meminfo").get("MemTotal")
    return round(int(total.split()[0]) / 2**20, 1) if total else None


def describe() -> dict[str, Any]:
    """nproc, cpus_usable, cpu_model, cpu_flags, ram_gib, torch, python, gpu, gpu_count."""
    import torch

    model, flags = cpu_model_and_flags()
    cuda = torch.cuda.is_available()
    return {
        "nproc": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "cpu_flags": flags,
        "ram_gib": ram_gib(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
    }
