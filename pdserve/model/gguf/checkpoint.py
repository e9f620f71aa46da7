"""A GGUF file's tensors under their Hugging Face names, dequantized to the serving dtype.

``GGUFCheckpoint`` answers the same ``get`` / ``in`` / ``close`` the model classes ask of a
safetensors ``Checkpoint``, so every model class loads from either. Names map
``model.layers.3.self_attn.q_proj.weight`` <-> ``blk.3.attn_q.weight`` and so on; each tensor
is dequantized once, when asked for, to float32, then cast to the serving dtype.

llama.cpp's converter reorders the rows of a llama model's Q and K projections so that its
rotary embedding rotates adjacent pairs: within each head, row ``2i + j`` of the GGUF tensor
is row ``j * head_dim/2 + i`` of the original. Loading undoes that (heads = n_head for Q,
n_kv_head for K); Qwen2 files are not reordered.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from pdserve.model.gguf.config import PERMUTED_QK
from pdserve.model.gguf.reader import GGUFError, GGUFFile
from pdserve.model.model_config import ModelConfig

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


def gguf_name(hf_name: str) -> str | None:
    """The GGUF tensor name of Hugging Face tensor ``hf_name``; None for one GGUF has no name for."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    match = _LAYER_NAME.fullmatch(hf_name)
    if match is None or match.group(2) not in _LAYER:
        return None
    layer, module, kind = match.groups()
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary reordering of a Q or K projection (weight or bias) of ``num_heads``."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


class GGUFCheckpoint:
    """The tensors of one GGUF file, by Hugging Face name, in ``dtype`` on ``device``."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.path = Path(config.path)
        self.device = device
        self.dtype = dtype
        self._file = GGUFFile(self.path)
        arch = config.get("gguf_architecture")
        self._heads = {}
        if arch in PERMUTED_QK:
            self._heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}

    def __contains__(self, name: str) -> bool:
        target = gguf_name(name)
        return target is not None and target in self._file.tensors

    def names(self) -> list[str]:
        """Every Hugging Face name this file holds a tensor for."""
        by_gguf = {v: k for k, v in _GLOBAL.items()}
        names = []
        for name in self._file.tensors:
            if name in by_gguf:
                names.append(by_gguf[name])
                continue
            parts = name.split(".")
            module = next((hf for hf, g in _LAYER.items() if g == parts[2]), None) if len(parts) == 4 else None
            if module is not None:
                names.append(f"model.layers.{parts[1]}.{module}.{parts[3]}")
        return names

    def is_block_fp8(self, name: str) -> bool:
        """Never: a GGUF file holds no block-FP8 weights, every tensor is dequantized at load."""
        return False

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``name`` dequantized to the model dtype (or ``dtype``) on the model device."""
        target = gguf_name(name)
        if target is None or target not in self._file.tensors:
            raise GGUFError(f"{self.path}: missing tensor {target or name} (for {name})")
        tensor = self._file.tensors[target]
        if tensor.shape != tuple(shape):
            raise GGUFError(f"{self.path}: tensor {target} has shape {list(tensor.shape)}, expected {list(shape)}")
        values = self._file.read(target)
        heads = self._heads.get(target.split(".")[2]) if target.startswith("blk.") else None
        if heads is not None:
            values = unpermute_rows(values, heads)
        return values.to(device=self.device, dtype=dtype or self.dtype)

    def close(self) -> None:
        """Loading is over: unmap the file (every tensor handed out is a copy)."""
        self._file.close()
