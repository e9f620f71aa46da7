"""Hypothesis strategies for fuzzing the public APIs: bodies and messages that are malformed,
mistyped, out of range, or valid, in any mix."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from pdserve.v1 import inference_pb2

_ANY_NUMBER = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True))
_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    _ANY_NUMBER,
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


def _maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly plausible values, sometimes anything at all."""
    return st.one_of(valid, valid, _JUNK)


def _token_ids(vocab: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.one_of(st.integers(0, vocab - 1), st.integers(-(2**40), 2**40)), max_size=12)


def _sampling_fields(model: str, vocab: int) -> dict[str, st.SearchStrategy[Any]]:
    return {
        "model": _maybe(st.sampled_from([model, "", "no-such-model"])),
        "max_tokens": _maybe(st.integers(-2, 12)),
        "temperature": _maybe(st.floats(-1, 3)),
        "top_p": _maybe(st.floats(-0.5, 1.5)),
        "top_k": _maybe(st.integers(-3, 50)),
        "n": _maybe(st.integers(-1, 3)),
        "seed": _maybe(st.integers(-(2**65), 2**65)),
        "stop": _maybe(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3))),
        "stream": _maybe(st.booleans()),
        "stream_options": _maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "ignore_eos": _maybe(st.booleans()),
        "min_tokens": _maybe(st.integers(-1, 3)),
        "repetition_penalty": _maybe(st.floats(-1, 3)),
        "presence_penalty": _maybe(st.floats(-3, 3)),
        "stop_token_ids": _maybe(_token_ids(vocab)),
    }


def completion_bodies(model: str, vocab: int) -> st.SearchStrategy[Any]:
    prompt = _maybe(
        st.one_of(
            st.text(max_size=40),
            st.lists(st.text(max_size=10), max_size=3),
            _token_ids(vocab),
            st.lists(_token_ids(vocab), max_size=3),
        )
    )
    fields = {**_sampling_fields(model, vocab), "echo": _maybe(st.booleans()), "logprobs": _maybe(st.integers(-1, 3))}
    return st.one_of(st.fixed_dictionaries({"prompt": prompt}, optional=fields), _JUNK)


def chat_bodies(model: str, vocab: int) -> st.SearchStrategy[Any]:
    content = _maybe(
        st.one_of(
            st.text(max_size=40),
            st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url"]), "text": _maybe(st.text(max_size=10))}
                ),
                max_size=2,
            ),
        )
    )
    message = _maybe(
        st.fixed_dictionaries({"role": _maybe(st.sampled_from(["system", "user", "assistant"])), "content": content})
    )
    fields = {
        **_sampling_fields(model, vocab),
        "logprobs": _maybe(st.booleans()),
        "max_completion_tokens": _maybe(st.integers(-1, 12)),
    }
    # max_tokens always: a chat without it may generate to the end of the context window.
    fields.pop("max_tokens")
    required = {"messages": _maybe(st.lists(message, max_size=4)), "max_tokens": st.integers(1, 12)}
    return st.one_of(st.fixed_dictionaries(required, optional=fields), _JUNK)


def generate_requests(model: str, vocab: int) -> st.SearchStrategy[inference_pb2.GenerateRequest]:
    """gRPC requests: every field the proto can carry, valid or not."""
    int32 = st.integers(-(2**31), 2**31 - 1)
    sampling = st.builds(
        inference_pb2.SamplingOptions,
        max_tokens=st.one_of(st.integers(-2, 12), int32),
        temperature=st.floats(allow_nan=True, allow_infinity=True),
        top_p=st.floats(allow_nan=True, allow_infinity=True),
        top_k=int32,
        min_p=st.floats(-1, 2),
        seed=st.integers(-(2**63), 2**63 - 1),
        stop=st.lists(st.text(max_size=4), max_size=3),
        stop_token_ids=st.lists(int32, max_size=3),
        ignore_eos=st.booleans(),
        repetition_penalty=st.floats(allow_nan=True, allow_infinity=True),
    )
    token_ids = st.lists(st.one_of(st.integers(0, vocab - 1), int32), max_size=12)
    prompt = st.one_of(
        st.builds(lambda t: {"text": t}, st.text(max_size=40)),
        st.builds(lambda ids: {"token_ids": inference_pb2.TokenIds(ids=ids)}, token_ids),
        st.just({}),
    )
    model_name = st.sampled_from([model, "", "no-such-model"])
    return st.builds(
        lambda m, p, s: inference_pb2.GenerateRequest(model=m, sampling=s, **p), model_name, prompt, sampling
    )
