"""Engine settings: one frozen struct, checked on construction."""

from __future__ import annotations

import msgspec

KERNEL_CHOICES = ("auto", "torch", "triton", "cpu")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
# auto: the KV cache in the model dtype; fp8_e4m3: float8_e4m3fn with per-layer scales.
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8_e4m3")
# The batch and token budget a worker starts with; the live knobs (discovery/knobs.py) start here too.
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 2048


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How an engine runs a model. Facts found at start-up (how many blocks fit) are
    reported by the engine, never written back here.

    The one place for the engine's options and their defaults: a worker gets it whole (a
    ``WorkerConfig`` field), and the command line's engine options (``cli/common.py``) take
    their defaults from here."""

    dtype: str | None = None  # one of DTYPE_CHOICES; None: the checkpoint's
    device: str = "auto"  # auto: cuda when available
    # auto: triton on cuda; on CPU the C kernels (cpu), or torch when no C compiler builds them
    kernels: str = "auto"
    block_size: int = 16
    # KV budget in bytes; None: gpu_memory_utilization of free GPU memory, or on CPU at most
    # cpu_kv_cache_memory (never more than max_num_seqs full contexts need).
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_memory: int = 4 * 2**30
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    seed: int = 0
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPE_CHOICES

    def __post_init__(self) -> None:
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {self.device!r}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {self.kernels!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        check_step_limits(self.max_num_seqs, self.max_num_batched_tokens)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


def check_step_limits(max_num_seqs: int, max_num_batched_tokens: int, prefix: str = "") -> None:
    """ValueError unless ``max_num_seqs >= 1`` and ``max_num_batched_tokens >= max_num_seqs``:
    every running decode takes one token of each step, so a step's budget must hold them all.
    ``prefix`` is the fields' prefix in the caller's struct (``"decode_"`` for ``Knobs``).

    The one copy of this check: ``EngineConfig``, the scheduler's config, live knobs and the
    engine's retune all call it."""
    if max_num_seqs < 1:
        raise ValueError(f"{prefix}max_num_seqs must be >= 1, got {max_num_seqs}")
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"{prefix}max_num_batched_tokens ({max_num_batched_tokens}) must be >= {prefix}max_num_seqs "
            f"({max_num_seqs}) so every running decode fits in one step"
        )
