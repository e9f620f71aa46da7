"""C kernels for CPUs, for the ops where torch's own CPU ops fall short.

Each op is one C file beside the Python function that calls it. The C files are compiled on
first use with the machine's C compiler (``build.py``; cached per source, flags and CPU) and
called through ``ctypes``, so installing pdserve needs no build step and a machine without a
compiler still runs, on the torch reference. ``CpuBackend`` (``cpu_backend.py``) is the
``Backend`` that uses them; every kernel is tested against ``TorchBackend``.

- ``cpu_backend``: ``CpuBackend``, the torch reference with these kernels where they matter most;
- ``build``: ``load_library``, a kernel's C file compiled once per machine, cached, loaded with ``ctypes``;
- ``paged_decode``: ``paged_decode`` and ``paged_prefill``, paged attention reading the cache in place;
- ``panel_gemm``: ``linear`` and ``gated_linear``, linear layers on weights packed into 32-column panels;
- ``layer_ops``: RMSNorm with its residual add, rotary embedding with the KV write, SwiGLU, greedy ``argmax``;
- ``heap``: ``keep_freed_memory``, glibc's malloc told to keep freed activations mapped between steps.
"""
