"""Model architectures pdserve runs, by the ``architectures`` name in config.json."""

from __future__ import annotations

import torch

from pdserve.distributed.parallel_state import SINGLE_RANK, ParallelState
from pdserve.kernels.backend import Backend
from pdserve.model.gguf.checkpoint import GGUFCheckpoint
from pdserve.model.gguf.config import is_gguf
from pdserve.model.model_config import ModelConfig
from pdserve.model.nn.base import DecoderModel
from pdserve.model.nn.deepseek import DeepseekModel
from pdserve.model.nn.llama import LlamaModel
from pdserve.model.weights import Checkpoint

MODEL_CLASSES: dict[str, type[DecoderModel]] = {
    "LlamaForCausalLM": LlamaModel,
    "Qwen2ForCausalLM": LlamaModel,
    "Qwen3ForCausalLM": LlamaModel,
    "MixtralForCausalLM": LlamaModel,
    "Qwen3MoeForCausalLM": LlamaModel,
    "DeepseekV2ForCausalLM": DeepseekModel,
    "DeepseekV3ForCausalLM": DeepseekModel,
}


def load_model(
    config: ModelConfig, device: torch.device, backend: Backend, parallel: ParallelState = SINGLE_RANK
) -> DecoderModel:
    """Build the model for ``config`` with weights mapped from its directory (or its GGUF file):
    the share of rank ``parallel`` of its group."""
    ckpt: Checkpoint
    if is_gguf(config.path):
        # Duck-typed: a GGUFCheckpoint reads tensors by name as a Checkpoint does.
        ckpt = GGUFCheckpoint(config, device=device, dtype=config.dtype)  # type: ignore[assignment]
    else:
        block_size = config.quantization.weight_block_size if config.quantization else None
        ckpt = Checkpoint(config.path, device=device, dtype=config.dtype, weight_block_size=block_size)
    try:
        return MODEL_CLASSES[config.architecture](config, ckpt, backend, parallel)
    finally:
        ckpt.close()


__all__ = ["DecoderModel", "MODEL_CLASSES", "load_model"]
