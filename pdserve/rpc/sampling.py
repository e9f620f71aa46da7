"""``SamplingOptions`` on the wire ↔ the engine's ``SamplingParams``."""

from __future__ import annotations

from typing import Any

from pdserve.types.sampling_params import SamplingParams
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
    return SamplingParams(**kwargs)
