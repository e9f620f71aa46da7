"""What every rank of an engine builds the same way: device, backend, model share, KV spec."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pdserve.distributed.parallel_state import ParallelState
from pdserve.kernels.backend import Backend
from pdserve.kernels.select import select_backend
from pdserve.model.config import read_model_config
from pdserve.model.kv_cache import KV_FP8_DTYPE, KVCacheSpec
from pdserve.model.load import DecoderModel, load_model
from pdserve.model.model_config import ModelConfig
from pdserve.types.engine_config import EngineConfig


@dataclass
class ModelSetup:
    device: torch.device
    model_config: ModelConfig
    backend: Backend
    model: DecoderModel
    kv_spec: KVCacheSpec  # this rank's KV cache: its heads (tensor parallelism) of every block


def setup_model(model: str, cfg: EngineConfig, parallel: ParallelState) -> ModelSetup:
    """Load rank ``parallel``'s share of ``model`` as ``cfg`` says."""
    if cfg.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(cfg.device)
    if device.type == "cuda" and parallel.world_size > 1:
        device = torch.device("cuda", torch.cuda.current_device())
    model_config = read_model_config(model, dtype=cfg.dtype)
    torch.manual_seed(cfg.seed)
    backend = select_backend(cfg.kernels, device)
    if cfg.kv_cache_dtype == "fp8_e4m3" and not backend.reads_fp8_kv:
        raise ValueError(
            f"kv_cache_dtype 'fp8_e4m3' runs on the torch and cpu kernels; the {backend.name} kernels "
            "do not read an FP8 KV cache yet"
        )
    loaded = load_model(model_config, device, backend, parallel)
    spec = loaded.kv_cache_spec(cfg.block_size)
    if cfg.kv_cache_dtype == "fp8_e4m3":
        spec = replace(spec, dtype=KV_FP8_DTYPE)  # the attention layers scale values in and out
    return ModelSetup(device, model_config, backend, loaded, spec)
