import math

import msgspec
import pytest

from pdserve.types.sampling_params import SamplingParams


def test_defaults():
    params = SamplingParams()
    assert params.max_tokens == 16
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == -1
    assert params.min_p == 0.0
    assert params.seed is None
    assert params.stop is None
    assert params.stop_token_ids is None
    assert params.ignore_eos is False
    assert params.logprobs is None
    assert params.repetition_penalty == 1.0
    assert params.presence_penalty == 0.0
    assert params.frequency_penalty == 0.0
    assert not params.is_greedy


def test_frozen_and_keyword_only():
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.temperature = 0.0
    with pytest.raises(TypeError):
        SamplingParams(16)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=1),
        dict(temperature=0),
        dict(temperature=2.5),
        dict(top_p=1e-6),
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=1),
        dict(top_k=50),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(seed=0),
        dict(seed=2**64 - 1),
        dict(stop=[]),
        dict(stop=["\n", "END"]),
        dict(stop_token_ids=[0, 2]),
        dict(ignore_eos=True),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(repetition_penalty=0.5),
        dict(presence_penalty=-2),
        dict(presence_penalty=2.0),
        dict(frequency_penalty=-2.0),
        dict(frequency_penalty=2),
    ],
)
def test_accepts_edge_values(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 16.0),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "1"),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 2.0),
        ("top_k", True),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("min_p", math.nan),
        ("seed", -1),
        ("seed", 2**64),
        ("seed", 1.5),
        ("seed", False),
        ("stop", ["ok", ""]),
        ("stop", [1]),
        ("stop", ("a",)),
        ("stop", "a"),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", 3),
        ("ignore_eos", 1),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
        ("logprobs", 2.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.nan),
        ("presence_penalty", 2.1),
        ("presence_penalty", -2.1),
        ("presence_penalty", math.nan),
        ("frequency_penalty", 2.1),
        ("frequency_penalty", -2.1),
        ("frequency_penalty", math.inf),
    ],
)
def test_rejects_bad_value_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**{field: value})


def test_error_message_states_the_range():
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 1.5$"):
        SamplingParams(top_p=1.5)


def test_bare_stop_string_asks_for_a_list():
    with pytest.raises(ValueError, match=r"pass \['END'\]"):
        SamplingParams(stop="END")


def test_decoding_validates_too():
    assert msgspec.json.decode(b'{"top_p": 0.5}', type=SamplingParams).top_p == 0.5
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        msgspec.json.decode(b'{"top_p": 1.5}', type=SamplingParams)


def test_round_trips_through_msgpack():
    params = SamplingParams(temperature=0.7, seed=3, stop=["x"], logprobs=5)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params


@pytest.mark.parametrize(
    "kwargs, greedy",
    [
        (dict(temperature=0.0), True),
        (dict(top_k=1), True),
        (dict(temperature=0.5), False),
        (dict(top_k=2), False),
        (dict(top_k=0), False),
    ],
)
def test_is_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).is_greedy is greedy
