import random

import pytest
import tokenizers
from tokenizers import decoders, models

from pdserve.text.detokenizer import IncrementalDetokenizer
from pdserve.text.tokenizer import Tokenizer
from tests.utils.tiny_tokenizer import write_tiny_tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Characters to build random valid texts from; the CJK and emoji outside the training corpus
# stay split into several byte tokens.
ALPHABET = (
    list("abcdefghij ABC .,!?\n")
    + list("éüñß")
    + list("你好世界龍鳳凰")
    + [
        "😀",
        "🚀",
        "🦀",
        "🧪",
        "👍🏽",
    ]
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(directory)
    return Tokenizer.from_pretrained(directory)


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> tuple[list[str], list[str]]:
    """Feed `token_ids` one by one, then flush; return the deltas and `text` after each step."""
    deltas: list[str] = []
    texts: list[str] = []
    for token_id in token_ids:
        deltas.append(detokenizer.add(token_id))
        texts.append(detokenizer.text)
    deltas.append(detokenizer.flush())
    texts.append(detokenizer.text)
    return deltas, texts


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(1, 30)))


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_ids_match_full_decode(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(1234)
    for _ in range(300):
        prompt = tokenizer.encode(random_text(rng)) if rng.random() < 0.7 else []
        # Any id at all, special tokens and lone UTF-8 continuation bytes included.
        output = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(40))]
        full = tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
        deltas, _ = stream(detokenizer, output)
        assert "".join(deltas) == detokenizer.text == full.rstrip(REPLACEMENT_CHAR)
        if REPLACEMENT_CHAR not in full:
            assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


def test_valid_text_never_emits_replacement_char(tokenizer: Tokenizer) -> None:
    rng = random.Random(99)
    num_split_chars = 0
    for _ in range(300):
        prompt = tokenizer.encode(random_text(rng))
        text = random_text(rng)
        output = tokenizer.encode(text, add_special_tokens=False)
        num_split_chars += sum(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in output)
        detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        deltas, _ = stream(detokenizer, output)
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
        assert "".join(deltas) == text
    assert num_split_chars > 100  # the test did exercise characters split across tokens


def test_split_character_is_emitted_once_complete(tokenizer: Tokenizer) -> None:
    output = tokenizer.encode("ok 🦀", add_special_tokens=False)
    assert len(output) >= 4
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    deltas = [detokenizer.add(token_id) for token_id in output]
    # The space shares a token with the emoji's first byte, so it waits for the emoji too.
    assert [delta for delta in deltas if delta] == ["o", "k", " 🦀"]
    assert detokenizer.flush() == ""


def test_flush_drops_a_character_cut_off_by_the_end(tokenizer: Tokenizer) -> None:
    output = tokenizer.encode("ok 🦀", add_special_tokens=False)[:-1]
    assert tokenizer.decode(output).endswith(REPLACEMENT_CHAR)
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, []), output)
    assert "".join(deltas) == "ok "


def test_prompt_context_keeps_leading_space() -> None:
    # A sentencepiece-style decoder drops the leading space of the first token it decodes, so
    # the first output token must be decoded after some prompt tokens.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    tokenizer = Tokenizer(backend)
    assert tokenizer.decode([2, 3]) == "world!"
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, [1]), [2, 3])
    assert "".join(deltas) == " world!"
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, []), [2, 3])
    assert "".join(deltas) == "world!"


def run_with_stop(
    tokenizer: Tokenizer, text: str, stop: list[str]
) -> tuple[IncrementalDetokenizer, list[str], list[str]]:
    detokenizer = IncrementalDetokenizer(tokenizer, [0], stop=stop)
    deltas, texts = stream(detokenizer, tokenizer.encode(text, add_special_tokens=False))
    assert "".join(deltas) == detokenizer.text
    for partial in texts:  # text only ever grows, and never shows what the stop cut off
        assert detokenizer.text.startswith(partial)
    return detokenizer, deltas, texts


def test_stop_string_that_is_one_token(tokenizer: Tokenizer) -> None:
    assert len(tokenizer.encode(" world", add_special_tokens=False)) == 1
    detokenizer, deltas, _ = run_with_stop(tokenizer, "Hello world, and more", [" world"])
    assert detokenizer.stopped
    assert detokenizer.text == "Hello"
    assert deltas[2:] == ["" for _ in deltas[2:]]  # tokens after the stop are ignored


def test_stop_string_spanning_tokens(tokenizer: Tokenizer) -> None:
    # "Hello" | " world": the stop starts inside the first token and ends in the second.
    detokenizer, deltas, _ = run_with_stop(tokenizer, "Hello world, and more", ["lo wor"])
    assert detokenizer.stopped
    assert detokenizer.text == "Hel"
    assert deltas[0] == "Hel"  # "lo" is held back after the first token: it may start a stop


def test_stop_string_at_the_very_start(tokenizer: Tokenizer) -> None:
    detokenizer, deltas, _ = run_with_stop(tokenizer, "Hello world", ["Hello"])
    assert detokenizer.stopped
    assert detokenizer.text == ""
    assert deltas == ["" for _ in deltas]


def test_earliest_stop_string_wins(tokenizer: Tokenizer) -> None:
    # Both complete with the token " world"; "lo w" starts first, whatever the list order.
    detokenizer, _, _ = run_with_stop(tokenizer, "Hello world, how", ["world", "lo w"])
    assert detokenizer.text == "Hel"
    # "world" completes tokens before "you", so generation stops there.
    detokenizer, _, _ = run_with_stop(tokenizer, "Hello world, how are you", ["you", "world"])
    assert detokenizer.text == "Hello "


def test_flush_releases_held_back_text(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [0], stop=["world"])
    deltas = [detokenizer.add(i) for i in tokenizer.encode("Hello wor", add_special_tokens=False)]
    assert "".join(deltas) == "Hello "  # "wor" could still become "world"
    assert detokenizer.flush() == "wor"
    assert not detokenizer.stopped
    assert detokenizer.text == "Hello wor"


def test_no_stop_string_emits_everything(tokenizer: Tokenizer) -> None:
    detokenizer, _, _ = run_with_stop(tokenizer, "Hello world, how are you", ["xyz", "wa"])
    assert not detokenizer.stopped
    assert detokenizer.text == "Hello world, how are you"


def test_random_stop_strings(tokenizer: Tokenizer) -> None:
    rng = random.Random(7)
    num_stopped = 0
    for _ in range(300):
        text = random_text(rng)
        # Pieces of this text (so stops happen) and of other random texts (so some do not).
        stop = []
        for _ in range(rng.randrange(1, 4)):
            source = text if rng.random() < 0.5 else random_text(rng)
            start = rng.randrange(len(source))
            stop.append(source[start : start + rng.randrange(1, 5)])
        detokenizer, _, _ = run_with_stop(tokenizer, text, stop)
        emitted = detokenizer.text
        assert text.startswith(emitted)
        assert not any(s in emitted for s in stop)
        if detokenizer.stopped:
            num_stopped += 1
            assert any(text[len(emitted) :].startswith(s) for s in stop)
        else:
            assert emitted == text
    assert num_stopped > 100


def test_after_stop_add_and_flush_emit_nothing(tokenizer: Tokenizer) -> None:
    detokenizer, _, _ = run_with_stop(tokenizer, "Hello world", [" world"])
    assert detokenizer.add(tokenizer.encode("again", add_special_tokens=False)[0]) == ""
    assert detokenizer.flush() == ""
    assert detokenizer.text == "Hello"


def test_empty_stop_string_is_rejected(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tokenizer, [], stop=["ok", ""])


def test_add_until_stop_takes_tokens_up_to_the_one_that_completes_the_stop(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode("Hello world, and more", add_special_tokens=False)  # "Hello" | " world" | ...
    detokenizer = IncrementalDetokenizer(tokenizer, [0], stop=["lo wor"])
    assert detokenizer.add_until_stop(tokens[:1]) == (1, "Hel")
    assert detokenizer.add_until_stop(tokens[1:]) == (1, "")  # " world" completes it; the rest is not taken
    assert detokenizer.stopped and detokenizer.add_until_stop(tokens) == (0, "")
    plain = IncrementalDetokenizer(tokenizer, [0])
    assert plain.add_until_stop(tokens) == (len(tokens), "Hello world, and more")
