"""The default model, the real SmolLM2-135M-Instruct (Q4_1 GGUF), against transformers loading
the same file: greedy tokens, a chat-templated prompt, and real text through the tokenizer."""

from __future__ import annotations

import jinja2
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.model.default_model import DEFAULT_MODEL_NAME, served_name
from pdserve.text.gguf_tokenizer import gguf_chat_template
from tests.utils.gguf_files import default_model

# Loads the real SmolLM2 into transformers (half a minute): the full run's, not the quick tier's.
pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
TEXTS = [
    "Hello world! The year 2024 had 366 days; 3.14159 ≈ π.",
    "  leading spaces,\ttabs\tand\n\nnew lines\r\n  ",
    "Café naïve résumé — Zürich, São Paulo; Привет мир; 你好，世界！こんにちは 😀🚀👍🏽",
    "<|im_start|>user\nWhat is 12345 * 678?<|im_end|>\n<|im_start|>assistant\n",
    "don't won't I'm we'll they've; CamelCaseIdentifiers snake_case_names x=1+2",
    "    def f(x):\n        return x ** 2  # square\n",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def path():
    return default_model()


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), max_model_len=512, max_num_seqs=4, kv_cache_memory=64 * 2**20)


@pytest.fixture(scope="module")
def reference(smollm2_reference):
    return smollm2_reference


def test_config_and_name(llm, path):
    config = llm.engine.model_config
    assert (config.architecture, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        "LlamaForCausalLM",
        30,
        576,
        9,
        3,
    )
    assert (config.vocab_size, config.intermediate_size, config.rope_theta) == (49152, 1536, 100000.0)
    assert config.tie_word_embeddings and config.dtype == torch.float32
    assert llm.engine.eos_token_ids == frozenset({2})  # <|im_end|>
    assert served_name(str(path)) == DEFAULT_MODEL_NAME


def test_tokenizer_ids_equal_transformers(llm, reference):
    tokenizer = reference.tokenizer
    for text in TEXTS:
        ids = llm.tokenizer.encode(text)
        assert ids == tokenizer(text).input_ids, text
        assert llm.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert llm.tokenizer.encode("2024") == [tokenizer.convert_tokens_to_ids(d) for d in "2024"]  # digit by digit


def test_greedy_tokens_equal_transformers(llm, reference):
    tokenizer = reference.tokenizer
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    for prompt, output in zip(PROMPTS, outputs):
        expected, num_clear = reference.greedy(tokenizer(prompt).input_ids, MAX_TOKENS)
        assert num_clear >= MAX_TOKENS // 2, f"{prompt!r}: the reference has a near tie early"
        assert output.token_ids[:num_clear] == expected[:num_clear], prompt
        assert output.text == tokenizer.decode(output.token_ids)


def test_chat_templated_prompt(llm, path, reference):
    tokenizer = reference.tokenizer
    template = gguf_chat_template(path)
    assert template is not None and "<|im_start|>" in template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=True)
    assert rendered == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = llm.tokenizer.encode(rendered)
    assert ids == tokenizer(rendered).input_ids
    output = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0))[0]
    expected, num_clear = reference.greedy(ids, len(output.token_ids))
    assert output.token_ids[:num_clear] == expected[:num_clear]
    assert "Paris" in output.text
    assert output.finish_reason == "stop" and output.token_ids[-1] == 2  # ended at <|im_end|>
