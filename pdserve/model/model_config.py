"""What pdserve needs to know about a model: ``ModelConfig``, whichever file it came from.

Common fields are normalised here; architecture-specific ones (MoE, MLA) are read by the
model classes from ``hf`` through ``get``/``require``, so an absent field names itself.
``config.read_model_config`` builds one from a Hugging Face directory or a GGUF file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdserve.types.engine_config import DTYPE_CHOICES

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)

_DTYPES = {name: getattr(torch, name) for name in DTYPE_CHOICES}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` (or a torch dtype) → torch dtype; only the dtypes pdserve computes in."""
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name}")
        return name
    key = str(name).removeprefix("torch.")
    aliases = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16", "fp16": "float16"}
    key = aliases.get(key, key)
    if key not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[key]


@dataclass(frozen=True)
class BlockFP8Quantization:
    """``quantization_config`` of a DeepSeek-V3-style FP8 checkpoint: linear weights stored as
    float8_e4m3fn with one float32 ``weight_scale_inv`` per ``weight_block_size`` block."""

    weight_block_size: tuple[int, int]  # (rows of out, columns of in) a block


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_model_len: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    dtype: torch.dtype
    hf: dict[str, Any] = field(repr=False)
    quantization: BlockFP8Quantization | None = None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.hf.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        if self.hf.get(key) is None:
            raise ValueError(f"{self.path / 'config.json'}: {self.architecture} needs field {key!r}")
        return self.hf[key]
