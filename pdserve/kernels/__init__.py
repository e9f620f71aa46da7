"""Kernels: the ``Backend`` interface the model computes through, and its implementations.

- ``backend``: ``Backend``, the ops a model calls (linear, norms, rotary, paged attention, MoE);
- ``torch_backend``: ``TorchBackend``, the plain torch reference every kernel is checked against;
- ``select``: ``select_backend``, which implementation a model runs on;
- ``block_fp8``: block-scaled FP8 weights and their torch arithmetic;
- ``triton_backend``: ``TritonBackend``, the ``Backend`` on the Triton kernels below;
- ``triton_mode``: whether the Triton kernels run compiled or in Triton's interpreter (CPU);
- ``common``: helpers the Triton kernels share;
- ``rms_norm``, ``rotary``, ``kv_write``, ``paged_decode``, ``paged_extend``, ``mla_decode``,
  ``mla_extend``, ``moe_routing``, ``moe_align``, ``moe_gemm``, ``moe_combine``,
  ``block_fp8_gemm``: the Triton kernels, one op a file, each checked against ``TorchBackend``;
- ``cpu``: ``CpuBackend``, oneDNN linears and C paged attention.

Importing the package loads nothing and changes nothing: Triton's interpreter is selected by
``triton_mode.use_interpreter_without_cuda``, which ``triton_backend`` calls before it loads the
kernels.
"""
