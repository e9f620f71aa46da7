"""The engine's per-token ``Logprobs`` on the wire (``TokenLogprobs``)."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.types.logprobs import Logprobs
from pdserve.v1 import inference_pb2


def token_logprobs(logprobs: Logprobs) -> inference_pb2.TokenLogprobs:
    """One token's logprobs as sent: the token's own, then the top-n best first."""
    return inference_pb2.TokenLogprobs(
        logprob=logprobs.token_logprob,
        top=[inference_pb2.TopLogprob(token_id=token_id, logprob=value) for token_id, value in logprobs.top],
    )


def tokens_logprobs(entries: Sequence[Logprobs | None]) -> list[inference_pb2.TokenLogprobs]:
    """Those of a run of tokens; empty when the request asked for none (every entry None)."""
    return [token_logprobs(entry) for entry in entries if entry is not None]
