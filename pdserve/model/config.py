"""Reading a model's configuration: one dispatch between a Hugging Face directory
(``config.json``) and a GGUF file (its metadata, ``gguf/config.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pdserve.model.gguf.config import gguf_model_config, is_gguf
from pdserve.model.model_config import SUPPORTED_ARCHITECTURES, BlockFP8Quantization, ModelConfig, parse_dtype


def read_model_config(path: str | Path, dtype: str | torch.dtype | None = None) -> ModelConfig:
    """The configuration of a Hugging Face model directory, or of a GGUF file (``*.gguf``)."""
    path = Path(path)
    if is_gguf(path):
        return gguf_model_config(path, dtype)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in model directory {path}")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_file}: not valid JSON ({error})") from None
    architectures = hf.get("architectures") or []
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        raise ValueError(
            f"{config_file}: unsupported architecture {architectures}; "
            f"pdserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise ValueError(f"{config_file}: missing field {key!r}")
        return hf[key]

    num_heads = need("num_attention_heads")
    rope_theta, rope_scaling = _read_rope(hf)
    config_dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    quantization = _read_quantization(hf.get("quantization_config"), config_file)
    return ModelConfig(
        path=path,
        architecture=architecture,
        vocab_size=need("vocab_size"),
        hidden_size=need("hidden_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or need("hidden_size") // num_heads,
        intermediate_size=hf.get("intermediate_size") or 0,
        rms_norm_eps=hf.get("rms_norm_eps") or 1e-6,
        max_model_len=hf.get("max_position_embeddings") or 4096,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        dtype=parse_dtype(dtype if dtype is not None else config_dtype),
        hf=hf,
        quantization=quantization,
    )


def _read_quantization(spec: Any, config_file: Path) -> BlockFP8Quantization | None:
    """``quantization_config``: absent, or block FP8 (``quant_method`` "fp8", ``fmt`` "e4m3",
    dynamic activations, any ``weight_block_size`` [bo, bi]); anything else is refused by name."""
    if spec is None:
        return None
    where = f"{config_file}: quantization_config"
    if not isinstance(spec, dict):
        raise ValueError(f"{where} must be an object, got {spec!r}")
    method = spec.get("quant_method")
    if method != "fp8":
        raise ValueError(f'{where}.quant_method {method!r} is not supported (pdserve reads "fp8")')
    if spec.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f'{where}.fmt {spec.get("fmt")!r} is not supported (pdserve reads "e4m3")')
    if spec.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f'{where}.activation_scheme {spec.get("activation_scheme")!r} is not supported (pdserve reads "dynamic")'
        )
    block = spec.get("weight_block_size")
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(f"{where}.weight_block_size must be two positive ints [rows, columns], got {block!r}")
    return BlockFP8Quantization(weight_block_size=(block[0], block[1]))


def _read_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Rope base and scaling from either the classic (``rope_theta`` + ``rope_scaling``) or the
    newer (``rope_parameters``) spelling of config.json."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    return theta, params
