"""A model's chat template: found in its directory, rendered with Jinja2 as transformers renders it.

Hugging Face models keep the template in ``chat_template.jinja`` or under ``chat_template`` in
``tokenizer_config.json`` (a string, or a list of named templates of which "default" is used);
a GGUF file keeps it in its metadata (``tokenizer.chat_template``).
``render_chat`` renders it in a sandboxed Jinja2 environment with the same settings and helpers
transformers gives templates (``trim_blocks``, ``lstrip_blocks``, loop controls, ``tojson``
that keeps non-ASCII text, ``raise_exception``, ``strftime_now``) and the tokenizer's special
tokens as variables, so that a prompt is the same text transformers' ``apply_chat_template``
makes. That text already holds its special tokens: tokenize it without adding more.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.text.tokenizer import TOKENIZER_CONFIG_FILE

TEMPLATE_FILE = "chat_template.jinja"
# tokenizer_config.json keys whose values templates use as variables (``{{ bos_token }}``).
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template cannot render these messages (its own ``raise_exception``, or a bad template)."""


def load_chat_template(model_path: str | Path) -> str | None:
    """The chat template's source in ``model_path``, or None when the model has none.

    Raises ValueError naming the file when one is there but unreadable.
    """
    if _is_gguf(model_path):
        from pdserve.text.gguf_tokenizer import gguf_chat_template  # torch: a frontend imports it only for GGUF

        return gguf_chat_template(model_path)
    directory = Path(model_path)
    template_file = directory / TEMPLATE_FILE
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    config = _tokenizer_config(directory)
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(
        f"{directory / TOKENIZER_CONFIG_FILE}: chat_template is neither a string nor a list "
        "of named templates with a 'default'"
    )


def load_special_tokens(model_path: str | Path) -> dict[str, str]:
    """The special tokens templates refer to by name (``bos_token``, ``eos_token``, ...)."""
    if _is_gguf(model_path):
        from pdserve.text.gguf_tokenizer import gguf_special_tokens

        return gguf_special_tokens(model_path)
    tokens = {}
    for key, value in _tokenizer_config(Path(model_path)).items():
        if key in _SPECIAL_TOKEN_KEYS:
            content = value.get("content") if isinstance(value, dict) else value
            if isinstance(content, str):
                tokens[key] = content
    return tokens


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    **variables: Any,
) -> str:
    """The prompt text for ``messages`` (dicts with "role" and "content"), ending with the
    assistant's turn opened when ``add_generation_prompt``. ``variables`` (e.g. ``tools``) reach
    the template as they are. Raises ChatTemplateError with the template's own message."""
    try:
        compiled = _compile(template)
        context = {**(special_tokens or {}), **variables}
        return compiled.render(context, messages=list(messages), add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template: {exc}") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
        # The template's own Python-level failure on these messages (e.g. None where it wants text).
        raise ChatTemplateError(f"chat template: {type(exc).__name__}: {exc}") from None


def _is_gguf(model_path: str | Path) -> bool:
    return Path(model_path).suffix.lower() == ".gguf"


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment.from_string(template)


def _tojson(
    value: Any, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False
) -> str:
    # Jinja2's own tojson escapes HTML characters and non-ASCII text; chat prompts want them as they are.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    path = directory / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    return config if isinstance(config, dict) else {}
