"""SamplingOptions on the wire → SamplingParams: unset fields keep the engine's defaults."""

from __future__ import annotations

import pytest

from pdserve.rpc.sampling import sampling_params, set_structured_output
from pdserve.types.sampling_params import SamplingParams
from pdserve.types.structured_output import StructuredOutput
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


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput(json_schema='{"type": "object"}'),
        StructuredOutput(regex="[0-9]+"),
        StructuredOutput(choice=("yes", "no")),
        StructuredOutput(grammar='start: "a"+'),
    ],
)
def test_a_structured_output_crosses_the_wire(spec):
    options = inference_pb2.SamplingOptions()
    set_structured_output(options, spec)
    wire = inference_pb2.SamplingOptions.FromString(options.SerializeToString())
    assert wire.WhichOneof("structured") == spec.kind
    assert sampling_params(wire).structured == spec
    assert sampling_params(inference_pb2.SamplingOptions()).structured is None


def test_a_structured_output_of_the_wrong_shape_names_the_field():
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        sampling_params(inference_pb2.SamplingOptions(choice=inference_pb2.StructuredChoice()))
    with pytest.raises(ValueError, match="json_schema: not valid JSON"):
        sampling_params(inference_pb2.SamplingOptions(json_schema="{"))
