"""Tiny GGUF files the tests write (llama and qwen2, mixed quant types) against transformers
loading the same file: greedy tokens and logprobs, the tokenizer's ids, the configuration."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.model.gguf.config import gguf_model_config
from pdserve.text.gguf_tokenizer import gguf_chat_template
from tests.utils.checkpoints import reference_greedy
from tests.utils.gguf_files import CONFIG, make_model, write_gguf

PROMPTS = [[5, 17, 33, 200, 7, 9], [100, 101, 102, 103], list(range(40, 90, 3))]
TEXTS = [
    "Hello, world! 2024 3.14159",
    "  déjà vu 你好 😀\n\nx\ty",
    "</s>Numbers: 0 1 22 333 4444<s>",
    "don't it's WE'LL",
]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request, tmp_path_factory):
    """(arch, GGUF path, pdserve LLM, transformers model loaded from the same GGUF)."""
    from transformers import AutoModelForCausalLM

    arch = request.param
    directory = tmp_path_factory.mktemp(f"gguf-{arch}")
    path = write_gguf(directory / f"tiny-{arch}.Q4_1.gguf", arch, make_model(arch))
    reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=path.name, dtype=torch.float32).eval()
    llm = LLM(str(path), max_model_len=128, kv_cache_memory=2**22)
    return arch, path, llm, reference


def test_config_comes_from_the_metadata(tiny):
    arch, path, llm, _ = tiny
    config = gguf_model_config(path)
    assert config.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        CONFIG["num_hidden_layers"],
        CONFIG["hidden_size"],
        CONFIG["num_attention_heads"],
        CONFIG["num_key_value_heads"],
        CONFIG["hidden_size"] // CONFIG["num_attention_heads"],
    )
    assert config.dtype == torch.float32 and not config.tie_word_embeddings
    assert llm.engine.eos_token_ids == frozenset({CONFIG["eos_token_id"]})
    assert gguf_model_config(path, dtype="bfloat16").dtype == torch.bfloat16


def test_greedy_tokens_and_logprobs_equal_transformers(tiny):
    _, _, llm, reference = tiny
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    outputs = llm.generate(PROMPTS, params)
    for prompt, output in zip(PROMPTS, outputs):
        expected, num_clear = reference_greedy(reference, prompt, 8)
        assert output.token_ids[:num_clear] == expected[:num_clear]
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt])).logits[0, -1].float()
        want = torch.log_softmax(logits, -1).topk(3)
        got = output.logprobs[0].top
        assert [t for t, _ in got] == want.indices.tolist()
        assert all(math.isclose(g, w, abs_tol=1e-4) for (_, g), w in zip(got, want.values.tolist()))


def test_tokenizer_ids_equal_transformers(tiny):
    from transformers import AutoTokenizer

    _, path, llm, _ = tiny
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = llm.tokenizer.encode(text)
        assert ids == reference(text).input_ids, text
        assert llm.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert llm.tokenizer.bos_token_id == CONFIG["bos_token_id"]
    assert gguf_chat_template(path) == reference.chat_template


def test_served_in_bfloat16(tiny):
    _, path, llm, _ = tiny
    bf16 = LLM(str(path), dtype="bfloat16", max_model_len=128, kv_cache_memory=2**22)
    assert bf16.engine.model_config.dtype == torch.bfloat16
    out = bf16.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
