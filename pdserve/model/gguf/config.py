"""A ``ModelConfig`` built from a GGUF file's metadata (``{arch}.block_count`` and the rest).

The Hugging Face-style ``hf`` dict carries what the model classes and the engine read from a
config.json: the architecture name, EOS and BOS. Rope scaling pdserve cannot reproduce from
GGUF metadata (llama3's ``rope_freqs`` tensor, yarn, ...) is refused, naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pdserve.model.gguf.reader import GGUFError, GGUFFile
from pdserve.model.model_config import ModelConfig, parse_dtype

# general.architecture -> the Hugging Face architecture pdserve's model classes know.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Architectures whose Q and K llama.cpp's converter permuted for its rotary layout.
PERMUTED_QK = frozenset({"llama"})
# GGUF's default serving dtype: the dequantized values are float32 and exact in it.
DEFAULT_DTYPE = torch.float32


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; the reader checks the magic)."""
    return Path(path).suffix.lower() == ".gguf"


def gguf_model_config(path: str | Path, dtype: str | torch.dtype | None = None) -> ModelConfig:
    """The model configuration of GGUF file ``path``, served in ``dtype`` (default float32)."""
    with GGUFFile(path) as file:
        return model_config_from(file, dtype)


def model_config_from(file: GGUFFile, dtype: str | torch.dtype | None = None) -> ModelConfig:
    """``gguf_model_config`` for a file already open."""
    meta = file.metadata
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{file.path}: general.architecture {arch!r} is not supported; pdserve serves GGUF "
            f"architectures {', '.join(sorted(ARCHITECTURES))}"
        )

    def need(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise GGUFError(f"{file.path}: missing metadata {arch}.{key}")
        return value

    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"{file.path}: {arch}.rope.scaling.type {scaling!r} is not supported (only none)")
    if "rope_freqs.weight" in file.tensors:
        raise GGUFError(f"{file.path}: tensor rope_freqs.weight (llama3 rope scaling) is not supported")
    hidden, num_heads = need("embedding_length"), need("attention.head_count")
    num_kv_heads = meta.get(f"{arch}.attention.head_count_kv") or num_heads
    if isinstance(num_kv_heads, list) or isinstance(num_heads, list):
        raise GGUFError(f"{file.path}: per-layer head counts are not supported")
    vocab_size = meta.get(f"{arch}.vocab_size") or _rows(file, "token_embd.weight")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    hf = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "eos_token_id": eos,
        "bos_token_id": bos,
        "gguf_architecture": arch,
    }
    return ModelConfig(
        path=file.path,
        architecture=ARCHITECTURES[arch],
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_layers=need("block_count"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=meta.get(f"{arch}.attention.key_length") or hidden // num_heads,
        intermediate_size=need("feed_forward_length"),
        rms_norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-6,
        max_model_len=meta.get(f"{arch}.context_length") or 4096,
        tie_word_embeddings="output.weight" not in file.tensors,
        rope_theta=float(meta.get(f"{arch}.rope.freq_base") or 10000.0),
        rope_scaling=None,
        dtype=parse_dtype(dtype) if dtype is not None else DEFAULT_DTYPE,
        hf=hf,
    )


def _rows(file: GGUFFile, name: str) -> int:
    tensor = file.tensors.get(name)
    if tensor is None:
        raise GGUFError(f"{file.path}: missing tensor {name}")
    return tensor.shape[0]
