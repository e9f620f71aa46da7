import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pdserve.text.tokenizer import Tokenizer
from tests.utils.tiny_tokenizer import CORPUS, write_tiny_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\ttabbed",
    "Crème brûlée in Zürich, ñandú.",
    "你好，世界！龍と鳳凰。",  # 龍 and 鳳凰 are not in the corpus, so they stay split into bytes
    "Rockets 🚀🚀, crabs 🦀, a family 👨‍👩‍👧 and 👍🏽.",
    "",
    *CORPUS,
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_dir)


def test_special_tokens_and_vocab_size(tokenizer: Tokenizer) -> None:
    assert tokenizer.bos_token_id == 0
    assert tokenizer.eos_token_id == 1
    assert tokenizer.vocab_size == 512


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert ids[1:] == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_multibyte_characters_are_split_across_tokens(tokenizer: Tokenizer) -> None:
    # The detokenizer tests rely on this: a character whose bytes span several tokens.
    for char in ["龍", "🦀"]:
        ids = tokenizer.encode(char, add_special_tokens=False)
        assert len(ids) > 1
        assert "\ufffd" in tokenizer.decode(ids[:1])


def test_matches_transformers(tiny_dir: Path, tokenizer: Tokenizer) -> None:
    hf_tokenizers = [
        AutoTokenizer.from_pretrained(tiny_dir),
        PreTrainedTokenizerFast(tokenizer_file=str(tiny_dir / "tokenizer.json")),
    ]
    rng = random.Random(0)
    random_ids = [[rng.randrange(tokenizer.vocab_size) for _ in range(20)] for _ in range(50)]
    for hf in hf_tokenizers:
        for text in TEXTS:
            for add_special_tokens in (True, False):
                assert tokenizer.encode(text, add_special_tokens) == hf.encode(
                    text, add_special_tokens=add_special_tokens
                )
        for ids in random_ids:
            for skip in (True, False):
                assert tokenizer.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
    auto = hf_tokenizers[0]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (auto.bos_token_id, auto.eos_token_id)
    assert tokenizer.vocab_size == len(auto)


@pytest.mark.parametrize(
    "extra_config",
    [
        {"add_bos_token": False},
        {"add_bos_token": True, "add_eos_token": True},
        # Special tokens written as AddedToken dicts, as older transformers saved them.
        {"eos_token": {"__type": "AddedToken", "content": "</s>", "special": True}},
    ],
)
def test_config_variants_match_transformers(tmp_path: Path, extra_config: dict[str, object]) -> None:
    write_tiny_tokenizer(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | extra_config))

    tokenizer = Tokenizer.from_pretrained(tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.eos_token_id == auto.eos_token_id == 1
    for text in TEXTS[:6]:
        assert tokenizer.encode(text) == auto.encode(text)


def test_missing_bos_and_eos_are_none(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    tokenizer = Tokenizer.from_pretrained(tmp_path)
    assert tokenizer.bos_token_id is None
    assert tokenizer.eos_token_id is None


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_missing_file_is_named(tmp_path: Path, name: str) -> None:
    write_tiny_tokenizer(tmp_path)
    (tmp_path / name).unlink()
    with pytest.raises(FileNotFoundError, match=name):
        Tokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_unreadable_file_is_named(tmp_path: Path, name: str) -> None:
    write_tiny_tokenizer(tmp_path)
    (tmp_path / name).write_text("{not json")
    with pytest.raises(ValueError, match=name):
        Tokenizer.from_pretrained(tmp_path)


def test_unknown_special_token_is_an_error(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    with pytest.raises(ValueError, match="<\\|end\\|>"):
        Tokenizer.from_pretrained(tmp_path)


def test_tiny_tokenizer_is_deterministic_and_bounded(tmp_path: Path) -> None:
    for name in ("a", "b"):
        write_tiny_tokenizer(tmp_path / name, vocab_size=300)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes()
    assert Tokenizer.from_pretrained(tmp_path / "a").vocab_size <= 300
    with pytest.raises(ValueError, match="vocab_size"):
        write_tiny_tokenizer(tmp_path / "c", vocab_size=200)
