"""A tiny real byte-level BPE tokenizer, trained in milliseconds, for tests and tiny checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
# The trainer gives special tokens the first ids in this order: <s>=0, </s>=1, <unk>=2.
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, UNK_TOKEN]

# Multilingual on purpose: with a few hundred merges the frequent CJK characters and emoji
# become whole tokens while rarer ones stay split into byte tokens, so tests see multi-byte
# characters spread over several tokens.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Hello, world! Hello again, world. How are you today? I am fine, thank you.",
    "A serving engine schedules requests, runs the model and streams tokens back.",
    "Prefill computes the prompt; decode generates one token at a time for each request.",
    "The cache stores keys and values in blocks, and blocks are shared between prompts.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -7 1e9.",
    "Code: def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Café, naïve, résumé, façade, déjà vu, crème brûlée, São Paulo, Zürich, Ærøskøbing.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein. Schöne Grüße aus München!",
    "¿Dónde está la biblioteca? Mañana será otro día, señor. Él comió una piña.",
    "Привет, мир! Как дела? Москва — столица России.",
    "Γειά σου κόσμε! Η γλώσσα είναι όμορφη.",
    "你好，世界！今天天气很好。我们一起去公园散步吧。",
    "大规模语言模型服务引擎，预填充和解码分离。你好你好世界世界。",
    "こんにちは世界！東京は日本の首都です。ありがとうございます。",
    "안녕하세요 세계! 서울은 한국의 수도입니다.",
    "مرحبا بالعالم! كيف حالك اليوم؟",
    "Emoji: 😀 😃 😄 😁 😆 🙂 🚀 🎉 👍 ❤️ 🔥 🌍 🤖 🍕 ✨ 😀😀🚀🚀🎉",
    "Flags and families: 🇯🇵 🇫🇷 👨‍👩‍👧‍👦 👍🏽 — mixed with text 😀 hello 🚀 world.",
    "Math: ∑ x² ≤ ∞, α + β = γ, √2 ≈ 1.414, π ≠ 3, ∀ε > 0 ∃δ.",
]


def write_tiny_tokenizer(directory: Path, vocab_size: int = 512) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` for a byte-level BPE into `directory`.

    The tokenizer has at most `vocab_size` ids (the 256 byte tokens, 3 special tokens and the
    merges learned from `CORPUS`), adds `<s>` in front of every encoded text, and uses `</s>` as
    EOS. The files are the same on every run.
    """
    num_base = 256 + len(SPECIAL_TOKENS)
    if vocab_size < num_base:
        raise ValueError(f"vocab_size must be at least {num_base} (bytes + special tokens)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
