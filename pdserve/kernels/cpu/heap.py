"""Keep the activations' memory in the process between steps (glibc's malloc).

A prompt chunk's activations are tens of megabytes a tensor (2048 tokens through a 3072-wide
gate/up projection: 25 MB), allocated and freed several times per layer. By default glibc
serves the largest of them with a fresh ``mmap`` and gives the heap's free top back to the
kernel as soon as 128 KiB of it is free, so every layer page-faults the same memory in
again: on the SmolLM2-135M shape a third of a 2048-token step's elementwise time, and about
a sixth of the whole prompt throughput (bench/RESULTS.md). Raising the two thresholds keeps
that memory mapped and reused. Peak RSS does not grow: it is the same working set, no
longer returned between layers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt's parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Allocations below this come from the heap (the KV cache, gigabytes, still gets its own mapping).
MMAP_THRESHOLD_BYTES = 256 << 20
# Free memory at the heap's top is returned to the kernel only past this much.
TRIM_THRESHOLD_BYTES = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
