"""Freed activations stay mapped: the page faults of reallocating the same large tensor."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.kernels.cpu.heap import keep_freed_memory

# Allocates, touches and frees a 48 MiB tensor ten times, after ten more that let the heap
# settle (glibc may grow it a few times before a freed chunk fits the next aligned request);
# prints the minor page faults of the last ten.
_PROGRAM = """
import resource, sys, torch
from pdserve.kernels.cpu.heap import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()

def use():
    x = torch.empty(12 << 20)
    x.fill_(1.0)

for _ in range(10):
    use()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    use()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _PROGRAM, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not keep_freed_memory(), reason="the C library is not glibc")
def test_a_reallocated_activation_is_not_faulted_in_again():
    pages = (48 << 20) // 4096
    default, kept = _faults("default"), _faults("keep")
    assert default > 5 * pages  # the default gives the memory back after each use
    assert kept < pages  # kept: the memory is reused as it is
