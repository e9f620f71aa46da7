"""Chat templates render to the same text as transformers' ``apply_chat_template``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pdserve.text.chat_template import (
    ChatTemplateError,
    load_chat_template,
    load_special_tokens,
    render_chat,
)
from tests.utils.tiny_tokenizer import write_tiny_tokenizer

# Exercises what templates in the wild use: special tokens, loop controls, tojson on
# non-ASCII text, raise_exception, whitespace control, and a generation prompt.
TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
{{ raise_exception('bad role: ' + message['role']) }}
    {% endif %}
    {% if loop.index0 > 8 %}{% break %}{% endif %}
<|{{ message['role'] }}|>
  {{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if tools %}
{{ tools | tojson }}
{% endif %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""
MESSAGES = [
    {"role": "system", "content": "  Réponds en français. "},
    {"role": "user", "content": "Hello 😀, 你好"},
    {"role": "assistant", "content": "Bonjour"},
    {"role": "user", "content": "<b>again</b>"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("chat")
    write_tiny_tokenizer(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return directory


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_equals_transformers(model_dir: Path, add_generation_prompt: bool):
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {}}}]
    reference = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        MESSAGES, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ours = render_chat(
        load_chat_template(model_dir),
        MESSAGES,
        add_generation_prompt=add_generation_prompt,
        special_tokens=load_special_tokens(model_dir),
        tools=tools,
    )
    assert ours == reference and "météo" in ours and "<s>" in ours


def test_a_template_file_wins_and_named_templates_use_default(tmp_path: Path):
    assert load_chat_template(tmp_path) is None  # no files at all
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
    )
    assert load_chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path) == "J"


def test_the_templates_own_exception_and_a_broken_template_are_errors(model_dir: Path):
    with pytest.raises(ChatTemplateError, match="bad role: robot"):
        render_chat(load_chat_template(model_dir), [{"role": "robot", "content": "hi"}])
    with pytest.raises(ChatTemplateError):
        render_chat("{% for %}", MESSAGES)
    with pytest.raises(ChatTemplateError):  # the sandbox refuses reaching into Python internals
        render_chat("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", MESSAGES)
