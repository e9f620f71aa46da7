"""SamplingOptions on the wire → SamplingParams: unset fields keep the engine's defaults."""

from __future__ import annotations

import pytest

from pdserve.rpc.sampling import sampling_params
from pdserve.types.sampling_params import SamplingParams
from pdserve.v1 import inference_pb2


def test_unset_fields_take_the_defaults_and_zero_is_a_value():
    assert sampling_params(inference_pb2.SamplingOptions()) == SamplingParams()
    params = sampling_params(
        inference_pb2.SamplingOptions(temperature=0.0, seed=0, stop=["x"], stop_token_ids=[3], ignore_eos=True)
    )
    assert params.temperature == 0.0 and params.seed == 0 and params.stop == ["x"] and params.stop_token_ids == [3]
    assert params.ignore_eos and params.max_tokens == SamplingParams().max_tokens
    assert params.logprobs is None
    assert sampling_params(inference_pb2.SamplingOptions(logprobs=0)).logprobs == 0


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match="max_tokens"):
        sampling_params(inference_pb2.SamplingOptions(max_tokens=0))
    with pytest.raises(ValueError, match="top_p"):
        sampling_params(inference_pb2.SamplingOptions(top_p=0.0))
    with pytest.raises(ValueError, match="logprobs"):
        sampling_params(inference_pb2.SamplingOptions(logprobs=21))
