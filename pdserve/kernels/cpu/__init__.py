"""C kernels for CPUs, for the ops where torch's own CPU ops fall short.

Each op is one C file beside the Python function that calls it. The C files are compiled on
first use with the machine's C compiler (``build.py``; cached per source, flags and CPU) and
called through ``ctypes``, so installing pdserve needs no build step and a machine without a
compiler still runs, on the torch reference. ``CpuBackend`` (``cpu_backend.py``) is the
``Backend`` that uses them; every kernel is tested against ``TorchBackend``.
"""
