"""A tiny DeepSeek-V3 checkpoint in DeepSeek's own FP8 format, and its dequantized twin.

The linear weights (``*_proj.weight``) are stored as F8_E4M3 with a float32
``*.weight_scale_inv`` per block of ``block_size`` (partial edge blocks included); embeddings,
norms, the MoE router and ``lm_head`` stay float32, as in the real checkpoints. The twin holds
exactly the values the FP8 weights stand for (each times its block's scale) in float32: the
checkpoint transformers runs as the reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.utils.checkpoints import write_checkpoint


def _is_quantized(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def quantize_blocks(weight: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values [out, in], float32 scales [ceil(out/bo), ceil(in/bi)]): each block's amax maps to 448."""
    bo, bi = block_size
    out, inp = weight.shape
    rows, cols = -(-out // bo), -(-inp // bi)
    scales = torch.empty(rows, cols)
    quantized = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    for r in range(rows):
        for c in range(cols):
            block = weight[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi].float()
            scale = block.abs().max().clamp(min=1e-12) / 448.0
            scales[r, c] = scale
            quantized[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi] = (block / scale).to(torch.float8_e4m3fn)
    return quantized, scales


def dequantize_blocks(quantized: torch.Tensor, scales: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    bo, bi = block_size
    out, inp = quantized.shape
    expanded = scales.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return quantized.float() * expanded


def write_fp8_deepseek_v3(directory: Path, reference_directory: Path, block_size: tuple[int, int], seed: int = 0):
    """Write the FP8 checkpoint to ``directory`` and its dequantized twin to
    ``reference_directory``; returns transformers' model of the twin."""
    write_checkpoint(reference_directory, "deepseek_v3", seed=seed)
    tensors = load_file(str(reference_directory / "model.safetensors"))
    fp8: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if _is_quantized(name, tensor):
            quantized, scales = quantize_blocks(tensor, block_size)
            fp8[name], fp8[f"{name}_scale_inv"] = quantized, scales
            dequantized[name] = dequantize_blocks(quantized, scales, block_size)
        else:
            fp8[name] = dequantized[name] = tensor
    save_file(dequantized, str(reference_directory / "model.safetensors"), metadata={"format": "pt"})
    directory.mkdir(parents=True, exist_ok=True)
    save_file(fp8, str(directory / "model.safetensors"), metadata={"format": "pt"})
    for file in reference_directory.iterdir():
        if file.name != "model.safetensors":
            shutil.copy(file, directory / file.name)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block_size),
    }
    (directory / "config.json").write_text(json.dumps(config))
    import transformers

    return transformers.DeepseekV3ForCausalLM.from_pretrained(reference_directory).eval()
