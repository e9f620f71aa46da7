"""``SamplingOptions`` on the wire ↔ the engine's ``SamplingParams``."""

from __future__ import annotations

from typing import Any

from pdserve.types.sampling_params import SamplingParams
from pdserve.types.structured_output import StructuredOutput
from pdserve.v1 import inference_pb2

_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "min_tokens",
)


def sampling_params(options: inference_pb2.SamplingOptions) -> SamplingParams:
    """The engine's params; unset fields keep their defaults. Raises ValueError naming a bad field."""
    kwargs: dict[str, Any] = {name: getattr(options, name) for name in _OPTIONAL_FIELDS if options.HasField(name)}
    if options.stop:
        kwargs["stop"] = list(options.stop)
    if options.stop_token_ids:
        kwargs["stop_token_ids"] = list(options.stop_token_ids)
    kwargs["ignore_eos"] = options.ignore_eos
    kwargs["structured"] = structured_output(options)
    return SamplingParams(**kwargs)


def structured_output(options: inference_pb2.SamplingOptions) -> StructuredOutput | None:
    """The options' structured output (the ``structured`` oneof), None when unset; raises
    ValueError naming the field when its shape is wrong (an empty choice list, say)."""
    kind = options.WhichOneof("structured")
    if kind is None:
        return None
    if kind == "choice":
        return StructuredOutput(choice=tuple(options.choice.options))
    return StructuredOutput(**{kind: getattr(options, kind)})


def set_structured_output(options: inference_pb2.SamplingOptions, spec: StructuredOutput) -> None:
    """Write ``spec`` into the options' ``structured`` oneof."""
    if spec.choice is not None:
        options.choice.options.extend(spec.choice)
    else:
        setattr(options, spec.kind, getattr(spec, spec.kind))
