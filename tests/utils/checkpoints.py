"""Tiny random checkpoints of every supported architecture, written with transformers.

Tests build their own models (no downloads); transformers' model code is the reference
pdserve's outputs are compared with.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.utils.tiny_tokenizer import write_tiny_tokenizer

VOCAB = 320
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.08,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)
_DEEPSEEK = dict(
    _COMMON,
    num_key_value_heads=4,
    moe_intermediate_size=32,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
)
_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _configs():
    import transformers as tf

    return {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(**_COMMON, rope_scaling=_LLAMA3_ROPE)),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(**_COMMON)),
        "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config(**_COMMON, head_dim=32)),
        "mixtral": (tf.MixtralForCausalLM, tf.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2)),
        "qwen3_moe": (
            tf.Qwen3MoeForCausalLM,
            tf.Qwen3MoeConfig(
                **_COMMON,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                norm_topk_prob=True,
                head_dim=16,
            ),
        ),
        "deepseek_v2_lite": (
            tf.DeepseekV2ForCausalLM,
            tf.DeepseekV2Config(
                **_DEEPSEEK, n_routed_experts=4, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0
            ),
        ),
        "deepseek_v3": (
            tf.DeepseekV3ForCausalLM,
            tf.DeepseekV3Config(
                **_DEEPSEEK,
                n_routed_experts=8,
                n_group=4,
                topk_group=2,
                q_lora_rank=24,
                routed_scaling_factor=2.5,
                rope_scaling=_YARN,
            ),
        ),
    }


ARCHITECTURES = ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v2_lite", "deepseek_v3")


def write_checkpoint(
    directory: Path,
    arch: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    num_layers: int | None = None,
):
    """Write a tiny random ``arch`` checkpoint with a tokenizer; returns the transformers model.
    ``num_layers``: other than the usual 2."""
    model_cls, config = _configs()[arch]
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if arch == "deepseek_v3":
        for layer in model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    write_tiny_tokenizer(directory, vocab_size=VOCAB)
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation.get("eos_token_id") == 1
    return model


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_new_tokens: int, margin: float = 1e-3) -> tuple[list[int], int]:
    """transformers' greedy continuation and how many leading tokens are clear of ties.

    Runs the full sequence each step (no cache) so the reference is as plain as it gets.
    Returns (tokens, n_clear): the first n_clear tokens had a top-1/top-2 logit gap above
    ``margin``; after a near tie, a different but equally valid continuation is possible.
    """
    ids = list(prompt)
    tokens, n_clear, clear = [], 0, True
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        top2 = logits.topk(2).values
        clear = clear and (top2[0] - top2[1]).item() > margin
        n_clear += clear
        token = int(logits.argmax())
        tokens.append(token)
        ids.append(token)
    return tokens, n_clear
