"""A request's output as its client sees it: token ids from the workers in, messages with text out.

Workers speak token ids only; the frontend detokenizes every request here, with one
``IncrementalDetokenizer`` a request, and applies its stop strings. The prefill worker's first
token and the decode worker's tokens go through the same detokenizer, so a stop string that
spans the hand-off is found like any other, and text held back at what may begin a stop string
is sent exactly once: cut at the stop, or at the end when no stop came.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.text.detokenizer import IncrementalDetokenizer
from pdserve.text.tokenizer import Tokenizer
from pdserve.v1 import inference_pb2


class TextStream:
    """Turns one request's tokens into ``GenerateResponse`` messages, ending at a stop string.

    ``add`` the tokens as the workers send them; once ``stopped``, the request is over: the
    caller ends the worker call and sends ``finish(message, ...)``. Without a tokenizer the
    messages carry no text and stop strings cannot match.
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], stop: list[str] | None) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, stop) if tokenizer is not None else None
        self.token_ids: list[int] = []  # tokens given to the client so far

    @property
    def num_tokens(self) -> int:
        """How many tokens the client was given so far."""
        return len(self.token_ids)

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the request (the token that completed it was the last)."""
        return self._detokenizer is not None and self._detokenizer.stopped

    def add(
        self, token_ids: Sequence[int], logprobs: Sequence[inference_pb2.TokenLogprobs] = ()
    ) -> inference_pb2.GenerateResponse:
        """The message for the workers' next tokens: those up to the one that completes a stop
        string, and the text now safe to send (never a broken UTF-8 sequence). ``logprobs``,
        one per token when the request asked for them, are cut with the tokens."""
        text = ""
        if self._detokenizer is not None:
            num_taken, text = self._detokenizer.add_until_stop(token_ids)
            token_ids = token_ids[:num_taken]
        self.token_ids += token_ids
        return inference_pb2.GenerateResponse(token_ids=token_ids, text=text, logprobs=logprobs[: len(token_ids)])

    def finish(self, message: inference_pb2.GenerateResponse, finish_reason: str) -> inference_pb2.GenerateResponse:
        """Make ``message`` (the last ``add``'s) the last one: with the text held back at a possible
        stop string when none came, and a ``final`` with the finish reason (``"stop"`` when a stop
        string ended the request, else ``finish_reason``), the whole text and the number of
        completion tokens. The caller adds the rest of the usage and the latency breakdown."""
        text = ""
        if self._detokenizer is not None:
            if not self._detokenizer.stopped:
                message.text += self._detokenizer.flush()
            text = self._detokenizer.text
        message.final.finish_reason = "stop" if self.stopped else finish_reason
        message.final.text = text
        message.final.usage.completion_tokens = self.num_tokens
        return message
