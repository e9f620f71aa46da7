"""Text <-> token ids for a Hugging Face model directory, backed by the `tokenizers` library."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class Tokenizer:
    """A fast tokenizer plus the special-token facts the engine needs (BOS, EOS, vocab size).

    `encode` and `decode` give the same ids and text as transformers' `AutoTokenizer` (the fast
    tokenizer) for the same files, without importing transformers.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        # One more than the largest id, so an embedding table of this size covers every id the
        # tokenizer can produce, added tokens included, even if the ids have gaps.
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values()) + 1
        # The most characters one token stands for: a text of N characters has at least
        # N / max_token_chars tokens. A byte-level vocabulary writes one character per byte,
        # and a byte fallback token ("<0xE3>") is longer than its byte, which only overstates it;
        # added tokens count by their content.
        self.max_token_chars: int = max(map(len, vocab))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load `tokenizer.json` and `tokenizer_config.json` from `model_dir`.

        BOS and EOS come from the config's `bos_token` / `eos_token`. Whether `encode` adds them
        is up to the post-processor in tokenizer.json alone: the config's `add_bos_token` and
        `add_eos_token` are ignored, as transformers (5.x) ignores them when tokenizer.json exists.

        Raises FileNotFoundError if either file is missing and ValueError if one cannot be
        parsed or names a special token the vocabulary lacks; the message names the file.
        """
        model_dir = Path(model_dir)
        backend = _load_backend(model_dir / TOKENIZER_FILE)
        config_path = model_dir / TOKENIZER_CONFIG_FILE
        config = _load_json(config_path)
        bos_token = _token_content(config.get("bos_token"))
        eos_token = _token_content(config.get("eos_token"))
        bos_token_id = _token_id(backend, bos_token, config_path)
        eos_token_id = _token_id(backend, eos_token, config_path)
        return cls(backend, bos_token_id=bos_token_id, eos_token_id=eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; `add_special_tokens` lets the post-processor add BOS/EOS.

        Safe to run on a thread beside an event loop: the batch call releases the GIL while it
        works (the single `encode` holds it, stalling every other thread for seconds on a
        megabyte prompt); the ids are the same.
        """
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text for `token_ids`; an incomplete multi-byte character decodes to U+FFFD.

        No "clean up tokenization spaces" pass: transformers skips it for BPE models too, and it
        would make the full decode disagree with the streamed text.
        """
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The whole tokenizer as ``tokenizer.json`` text (what a grammar engine builds its
        token table from)."""
        return self._backend.to_str()


def find_tokenizer(model: str | Path) -> Tokenizer | None:
    """The tokenizer of a model: a GGUF file's embedded one, a directory's tokenizer.json, or
    None when a directory has no tokenizer.json (token-id prompts only)."""
    model = Path(model)
    if model.suffix.lower() == ".gguf":
        # Imported here: the GGUF reader imports torch, which a frontend serving a Hugging Face
        # directory never needs.
        from pdserve.text.gguf_tokenizer import load_gguf_tokenizer

        return Tokenizer(*load_gguf_tokenizer(model))
    return Tokenizer.from_pretrained(model) if (model / TOKENIZER_FILE).is_file() else None


def _load_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception for any parse error
        raise ValueError(f"cannot read tokenizer file {path}: {e}") from e


def _load_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer config not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read tokenizer config {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"tokenizer config {path} is not a JSON object")
    return data


def _token_content(value: str | dict[str, Any] | None) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _token_id(backend: tokenizers.Tokenizer, token: str | None, config_path: Path) -> int | None:
    if token is None:
        return None
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise ValueError(f"{config_path}: special token {token!r} is not in the vocabulary")
    return token_id
