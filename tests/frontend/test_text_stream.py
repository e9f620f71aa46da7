"""The frontend's detokenize-and-stop step: worker token ids in, the client's messages out.

The prefill worker's first token and the decode worker's tokens reach ``TextStream`` as
separate batches; the text must come out as if one detokenizer had seen them all, the first
token exactly once, a stop string cut wherever it falls, and nothing past it sent.
"""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.frontend.text_stream import TextStream
from pdserve.text.tokenizer import Tokenizer
from pdserve.v1 import inference_pb2
from tests.utils.stop_strings import stop_after_the_first_token
from tests.utils.tiny_tokenizer import write_tiny_tokenizer

PROMPT = [0]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(directory)
    return Tokenizer.from_pretrained(directory)


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def run(stream: TextStream, batches: list[list[int]], finish_reason: str) -> list[inference_pb2.GenerateResponse]:
    """Feed the batches as workers would send them, until the end or a stop string."""
    messages = []
    for batch in batches:
        messages.append(stream.add(batch))
        if stream.stopped:
            break
    stream.finish(messages[-1], finish_reason)
    return messages


def test_a_stop_string_spanning_the_hand_off_is_cut_and_later_tokens_are_not_sent(tokenizer):
    tokens = ids(tokenizer, "Hello world, and more")  # "Hello" | " world" | "," | ...
    stream = TextStream(tokenizer, PROMPT, ["lo wor"])
    first = stream.add(tokens[:1])
    assert (list(first.token_ids), first.text) == (tokens[:1], "Hel")  # "lo" may begin the stop
    assert not stream.stopped
    last = stream.add(tokens[1:])  # the decode worker's batch: the stop completes in its first token
    assert stream.stopped and (list(last.token_ids), last.text) == (tokens[1:2], "")
    stream.finish(last, "length")
    assert (last.final.finish_reason, last.final.text, last.final.usage.completion_tokens) == ("stop", "Hel", 2)
    assert last.text == ""  # what the stop cut is never sent


def test_logprobs_are_cut_with_the_tokens_at_a_stop_string(tokenizer):
    tokens = ids(tokenizer, "Hello world, and more")
    logprobs = [
        inference_pb2.TokenLogprobs(logprob=-float(i), top=[inference_pb2.TopLogprob(token_id=t, logprob=-0.5)])
        for i, t in enumerate(tokens)
    ]
    stream = TextStream(tokenizer, PROMPT, ["lo wor"])
    first = stream.add(tokens[:1], logprobs[:1])
    last = stream.add(tokens[1:], logprobs[1:])
    assert stream.stopped and list(first.logprobs) == logprobs[:1] and list(last.logprobs) == logprobs[1:2]
    assert not TextStream(tokenizer, PROMPT, None).add(tokens).logprobs  # none asked for, none sent


def test_text_held_back_at_a_possible_stop_is_sent_once_at_the_end(tokenizer):
    tokens = ids(tokenizer, "Hello")
    stream = TextStream(tokenizer, PROMPT, ["lo!"])
    [message] = run(stream, [tokens], "length")  # a request that ends at its first token
    assert message.text == "Hello" and message.final.text == "Hello"
    assert message.final.finish_reason == "length" and message.final.usage.completion_tokens == 1
    stream = TextStream(tokenizer, PROMPT, ["lo!"])
    first, last = run(stream, [tokens, []], "stop")  # EOS-like end: the worker's final has no tokens
    assert (first.text, last.text, last.final.text) == ("Hel", "lo", "Hello")


def test_a_stop_string_inside_the_first_token_ends_the_request_there(tokenizer):
    tokens = ids(tokenizer, "Hello world")
    stream = TextStream(tokenizer, PROMPT, ["ell"])
    first = stream.add(tokens[:1])
    assert stream.stopped and (list(first.token_ids), first.text) == (tokens[:1], "H")
    stream.finish(first, "length")
    assert (first.final.finish_reason, first.final.text, first.final.usage.completion_tokens) == ("stop", "H", 1)


def test_without_a_stop_the_deltas_join_to_the_decoded_text_and_never_split_a_character(tokenizer):
    text = "Hi 🧪! 🦀 crab, 你好世界"
    tokens = ids(tokenizer, text)
    stream = TextStream(tokenizer, PROMPT, None)
    messages = run(stream, [[t] for t in tokens], "length")
    assert all("\ufffd" not in m.text for m in messages)
    assert "".join(m.text for m in messages) == messages[-1].final.text == text
    assert [t for m in messages for t in m.token_ids] == tokens
    assert messages[-1].final.usage.completion_tokens == len(tokens)


def test_without_a_tokenizer_tokens_pass_and_there_is_no_text():
    stream = TextStream(None, PROMPT, ["x"])
    messages = run(stream, [[5], [6, 7]], "length")
    assert [list(m.token_ids) for m in messages] == [[5], [6, 7]] and not stream.stopped
    assert messages[-1].final.text == "" and messages[-1].final.usage.completion_tokens == 3


@pytest.mark.parametrize("max_tokens", [1, 8])
def test_the_first_token_then_the_rest_equal_the_offline_completion(checkpoints, max_tokens):
    """A stop string that begins in the first token's text (the prefill worker's) and that a
    later token completes (max_tokens=8), or that never completes in a request ending at the
    first token (max_tokens=1): the client gets the offline API's text, each character once."""
    path, _ = checkpoints("llama")
    offline = LLM(str(path))
    prompt, stop = stop_after_the_first_token(offline, completes=max_tokens > 1)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    # What the workers send: the engine knows no stop strings, so it runs to max_tokens.
    tokens = offline.generate([prompt], greedy)[0].token_ids
    want = offline.generate(
        [prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    assert want.finish_reason == ("stop" if max_tokens > 1 else "length")
    stream = TextStream(offline.tokenizer, prompt, [stop])
    messages = run(stream, [tokens[:1], tokens[1:]], "length")
    final = messages[-1].final
    assert [t for m in messages for t in m.token_ids] == want.token_ids
    assert ("".join(m.text for m in messages), final.text, final.finish_reason) == (
        want.text,
        want.text,
        want.finish_reason,
    )
    assert final.usage.completion_tokens == len(want.token_ids)
