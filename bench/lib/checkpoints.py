"""Random-weight checkpoints of named model shapes, written with transformers' ``save_pretrained``.

Contract: ``write_checkpoint`` writes a whole Hugging Face directory (config.json and
safetensors, no tokenizer: the benches send token ids) and returns the config fields a report
needs; the same shape and seed give the same weights. transformers and torch are imported by
the functions that need them, not by this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Llama 3 rope scaling, as in Llama-3.1-8B's config.json.
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Shape:
    """A model shape: the transformers classes to build it and the config fields."""

    description: str
    model_class: str  # transformers class name
    config_class: str
    config: dict[str, Any]


SHAPES: dict[str, Shape] = {
    "tiny": Shape(
        "small Llama (hidden 512, 4 layers, 8 heads / 4 KV heads of 64, vocab 32000); the default workload takes minutes on 2 CPU cores",
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1376,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=2048,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "smollm2-135m": Shape(
        "the real SmolLM2-135M config (30 layers, hidden 576, 9 heads / 3 KV heads of 64, FFN 1536, "
        "vocab 49152, tied embeddings)",
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "llama-31m": Shape(
        "a 31M-parameter Llama (8 layers, hidden 512, 8 heads / 4 KV heads of 64, FFN 1376, vocab 8192)",
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            vocab_size=8192,
            hidden_size=512,
            intermediate_size=1376,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=2048,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "llama-3.1-8b": Shape(
        "the real Llama-3.1-8B config (32 layers, hidden 4096, 32 heads / 8 KV heads of 128, vocab 128256, "
        "llama3 rope); 16 GB in bfloat16: a GPU shape, or use --num-layers on CPU",
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling=_LLAMA3_ROPE,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=128000,
            eos_token_id=128001,
        ),
    ),
    "deepseek-v2-lite": Shape(
        "the real DeepSeek-V2-Lite config (27 layers, hidden 2048, 16 MLA heads, kv_lora 512 / rope 64 / "
        "nope 128 / v 128, 64 routed experts top-6 + 2 shared, vocab 102400, yarn rope); 31 GB in float32",
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        dict(
            vocab_size=102400,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_shared_experts=2,
            n_routed_experts=64,
            num_experts_per_tok=6,
            first_k_dense_replace=1,
            moe_layer_freq=1,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            max_position_embeddings=163840,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            bos_token_id=100000,
            eos_token_id=100001,
        ),
    ),
    "deepseek-v3-mini": Shape(
        "DeepSeek-V3 architecture with V3's real MLA dims (q_lora 1536, kv_lora 512, rope 64, nope 128, v 128) "
        "and router (sigmoid, grouped top-k, correction bias, scaling 2.5) but small elsewhere: hidden 1024, "
        "16 heads, 4 layers (1 dense), 16 routed experts top-4 in 4 groups (top 2) + 1 shared, vocab 32000",
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=2816,
            moe_intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_shared_experts=1,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            max_position_embeddings=163840,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
        ),
    ),
}

# A few-second model for smoke runs (the size of the tests' tiny Llama).
SMOKE = Shape(
    "a tiny Llama (hidden 64, 2 layers, 4 heads / 2 KV heads of 16, vocab 320) for smoke runs",
    "LlamaForCausalLM",
    "LlamaConfig",
    dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.08,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    ),
)


def write_checkpoint(shape: Shape, directory: Path, dtype: str, seed: int, num_layers: int | None) -> dict[str, Any]:
    """Random weights of ``shape`` saved with ``save_pretrained``; returns the config fields used."""
    import torch
    import transformers

    fields = dict(shape.config)
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
        fields["first_k_dense_replace"] = min(fields.get("first_k_dense_replace", 0), max(num_layers - 1, 0))
    config = getattr(transformers, shape.config_class)(**fields)
    torch.manual_seed(seed)
    # On a GPU the random init of an 8B model takes a moment instead of minutes of CPU.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = getattr(transformers, shape.model_class)._from_config(config, dtype=getattr(torch, dtype)).eval()
    if shape.model_class == "DeepseekV3ForCausalLM":
        # A zero correction bias (the init) would leave V3's bias path untested by the routing.
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.data.normal_(0, 0.05)
    model.save_pretrained(directory)
    num_params = sum(p.numel() for p in model.parameters())
    del model
    return {
        "num_parameters": num_params,
        "num_hidden_layers": fields["num_hidden_layers"],
        "vocab_size": fields["vocab_size"],
    }


def read_checkpoint_info(directory: Path) -> dict[str, Any]:
    """The config fields the report needs, from an existing checkpoint's config.json."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise SystemExit(f"--model {directory}: no config.json there")
    config = json.loads(config_file.read_text())
    return {
        "num_parameters": None,
        "num_hidden_layers": config.get("num_hidden_layers"),
        "vocab_size": config["vocab_size"],
    }
