"""The tokenizer a GGUF file embeds, rebuilt as a ``tokenizers.Tokenizer``; its chat template.

``tokenizer.ggml.model = gpt2`` files carry a byte-level BPE: ``tokens`` (the vocabulary, id =
position), ``merges`` (``"a b"`` in rank order) and ``token_type`` (3 = control, 4 =
user-defined: added tokens matched before BPE). ``tokenizer.ggml.pre`` names the
pre-tokenizer llama.cpp applies; each supported one is rebuilt here from its definition:

- ``smollm``: every digit on its own, then byte-level splitting with GPT-2's regex.
- ``gpt2`` / ``default``: byte-level splitting with GPT-2's regex.
- ``llama-bpe`` (Llama 3) and ``qwen2``: their own split regex (numbers in runs of up to three
  digits, or one digit), then byte-level without a regex; ``qwen2`` normalizes to NFC first.

Any other pre-tokenizer or tokenizer model is refused, naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from pdserve.model.gguf.reader import GGUFError, GGUFFile

_CONTROL, _USER_DEFINED = 3, 4


class GGUFTokenizer(NamedTuple):
    """What ``text.tokenizer.Tokenizer`` is built from; kept apart so that this module, which
    the tokenizer imports for GGUF files only, does not import it back."""

    backend: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None


_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_SPLIT_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _SPLIT_TAIL
_QWEN2_SPLIT = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _SPLIT_TAIL
SUPPORTED_PRE_TOKENIZERS = ("default", "gpt2", "llama-bpe", "qwen2", "smollm")


def _byte_level(use_regex: bool) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated", invert=False)


def _pre_tokenizer(name: str, path: Path) -> pre_tokenizers.PreTokenizer:
    if name in ("default", "gpt2"):
        return _byte_level(True)
    if name == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level(True)])
    if name == "llama-bpe":
        return pre_tokenizers.Sequence([_split(_LLAMA3_SPLIT), _byte_level(False)])
    if name == "qwen2":
        return pre_tokenizers.Sequence([_split(_QWEN2_SPLIT), _byte_level(False)])
    raise GGUFError(
        f"{path}: tokenizer.ggml.pre {name!r} is not supported; pdserve rebuilds {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
    )


def gguf_tokenizer(file: GGUFFile) -> GGUFTokenizer:
    """The tokenizer embedded in ``file``, with its BOS and EOS."""
    meta, path = file.metadata, file.path
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (only gpt2, byte-level BPE)")
    tokens: list[str] | None = meta.get("tokenizer.ggml.tokens")
    merges: list[str] | None = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise GGUFError(f"{path}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise GGUFError(f"{path}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens")
    pre = meta.get("tokenizer.ggml.pre", "default")
    vocab = {token: index for index, token in enumerate(tokens)}
    try:
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
        # A merge without a space is a 1-tuple here, left for BPE to reject.
        bpe = models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False)  # type: ignore[arg-type]
    except Exception as error:  # the Rust side raises a bare Exception for a merge outside the vocabulary
        raise GGUFError(f"{path}: tokenizer.ggml.merges do not fit the vocabulary ({error})") from None
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = _pre_tokenizer(pre, path)
    if pre == "qwen2":
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens(
        [
            tokenizers.AddedToken(tokens[i], special=token_types[i] == _CONTROL, normalized=False)
            for i in range(len(tokens))
            if token_types[i] in (_CONTROL, _USER_DEFINED)
        ]
    )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    for key, value in (("bos", bos), ("eos", eos)):
        if value is not None and not 0 <= value < len(tokens):
            raise GGUFError(f"{path}: tokenizer.ggml.{key}_token_id {value} is outside the vocabulary of {len(tokens)}")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)]
        )
    return GGUFTokenizer(backend, bos, eos)


def gguf_chat_template(path: str | Path) -> str | None:
    """The chat template (Jinja source) embedded in GGUF file ``path``, or None when it has none."""
    with GGUFFile(path) as file:
        template = file.metadata.get("tokenizer.chat_template")
    return template if isinstance(template, str) else None


def gguf_special_tokens(path: str | Path) -> dict[str, str]:
    """The text of the special tokens chat templates use as variables (``bos_token``,
    ``eos_token``, ``unk_token``, ``pad_token``) that GGUF file ``path`` names."""
    with GGUFFile(path) as file:
        meta = file.metadata
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    found = {}
    for variable, key in (
        ("bos_token", "bos"),
        ("eos_token", "eos"),
        ("unk_token", "unknown"),
        ("pad_token", "padding"),
    ):
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        if index is not None and 0 <= index < len(tokens):
            found[variable] = tokens[index]
    return found


def load_gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    """The tokenizer embedded in GGUF file ``path``."""
    with GGUFFile(path) as file:
        return gguf_tokenizer(file)
