"""Tiny GGUF files written with ``gguf.GGUFWriter`` from a random transformers model.

Each tensor is stored in the ggml type its name picks (``QTYPES``, a mix that covers every
dequantization path: pdserve's own Q8_0/Q4_0/Q4_1/F16/BF16/F32 and ``gguf.quants``' Q5_0),
Q and K of a llama model reordered as llama.cpp's converter does, and the tiny test tokenizer
embedded as byte-level BPE metadata. The default model (SmolLM2-135M-Instruct) is where
setup.sh puts it: ``DEFAULT_MODEL``.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pdserve.model.default_model import FETCH_HINT, default_model_path
from tests.utils.tiny_tokenizer import SPECIAL_TOKENS, write_tiny_tokenizer

Q = gguf.GGMLQuantizationType
VOCAB = 320
CONFIG = dict(
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
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)
# GGUF tensor name part -> its ggml type (norms and biases stay F32, as llama.cpp writes them).
QTYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.F16,
    "attn_q": Q.Q4_1,
    "attn_k": Q.Q4_0,
    "attn_v": Q.Q5_0,
    "attn_output": Q.BF16,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.Q8_0,
    "ffn_down": Q.Q4_0,
}
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def make_model(arch: str, seed: int = 0):
    """A tiny random transformers model of ``arch`` (llama or qwen2)."""
    import transformers as tf

    model_cls, config_cls = {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config),
    }[arch]
    torch.manual_seed(seed)
    return model_cls(config_cls(**CONFIG)).eval()


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's reordering of Q/K rows: within a head, rows (j * half + i) go to (2i + j)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(
    path: Path, arch: str, model, pre: str = "qwen2", qtypes: dict | None = None, metadata: dict | None = None
) -> Path:
    """Write ``model`` (from ``make_model``) as GGUF file ``path`` with the tiny tokenizer."""
    qtypes = QTYPES if qtypes is None else qtypes
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(CONFIG["num_hidden_layers"])
    writer.add_context_length(CONFIG["max_position_embeddings"])
    writer.add_embedding_length(CONFIG["hidden_size"])
    writer.add_feed_forward_length(CONFIG["intermediate_size"])
    writer.add_head_count(CONFIG["num_attention_heads"])
    writer.add_head_count_kv(CONFIG["num_key_value_heads"])
    writer.add_rope_freq_base(CONFIG["rope_theta"])
    writer.add_layer_norm_rms_eps(CONFIG["rms_norm_eps"])
    writer.add_vocab_size(VOCAB)
    _add_tokenizer(writer, path.parent / f"{path.stem}-tokenizer", pre)
    for key, value in (metadata or {}).items():
        writer.add_key_value(key, value[0], value[1])
    for name, tensor in model.state_dict().items():
        target = _gguf_name(name)
        values = tensor.float().numpy()
        part = target.split(".")[-2] if target.startswith("blk.") else target.split(".")[0]
        if arch == "llama" and part in ("attn_q", "attn_k"):
            heads = CONFIG["num_attention_heads"] if part == "attn_q" else CONFIG["num_key_value_heads"]
            values = _permute(values, heads)
        qtype = qtypes.get(part, Q.F32) if values.ndim == 2 else Q.F32
        if qtype == Q.F32:
            writer.add_tensor(target, np.ascontiguousarray(values))
        elif qtype == Q.F16:
            writer.add_tensor(target, values.astype(np.float16))
        elif qtype in gguf.quants._type_traits:
            writer.add_tensor(target, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:  # a type nothing quantizes (nor dequantizes): zero bytes of the right size
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((values.shape[0], values.shape[1] // block * size), dtype=np.uint8)
            writer.add_tensor(target, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: gguf.GGUFWriter, scratch: Path, pre: str) -> None:
    write_tiny_tokenizer(scratch, vocab_size=VOCAB)
    spec = json.loads((scratch / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if token in SPECIAL_TOKENS else 1 for token in tokens])
    writer.add_bos_token_id(vocab[SPECIAL_TOKENS[0]])
    writer.add_eos_token_id(vocab[SPECIAL_TOKENS[1]])
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}")


class Reference:
    """transformers running a GGUF file (``gguf_file=``), float32: the model and its tokenizer."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        # Generate past EOS, as pdserve does with ignore_eos (min_new_tokens would mask EOS instead).
        self.model.generation_config.eos_token_id = None

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int, margin: float = 1e-3) -> tuple[list[int], int]:
        """Greedy tokens and how many leading ones were clear of a near tie (as ``reference_greedy``),
        with transformers' KV cache: the real model is too slow to rerun the whole sequence each step."""
        out = self.model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=self.tokenizer.eos_token_id,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        num_clear = 0
        for scores in out.scores:
            top2 = scores[0].float().topk(2).values
            if (top2[0] - top2[1]).item() <= margin:
                break
            num_clear += 1
        return tokens, num_clear


def default_model() -> Path:
    """The default model's GGUF file; the test fails, saying how to fetch it, when it is missing."""
    path = default_model_path()
    if not path.is_file():
        pytest.fail(f"the default model is not at {path}: {FETCH_HINT}")
    return path
