"""OpenAI's ``logprobs`` objects, from the per-token ``TokenLogprobs`` the gateway streams.

Completions use the legacy shape (``tokens``, ``token_logprobs``, ``top_logprobs`` as one
``{token: logprob}`` map a token, ``text_offset``); chat completions the newer one
(``content``: a list of ``{token, logprob, bytes, top_logprobs}``). A token's text is its own
decoded text (special tokens kept), as vLLM reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from pdserve.v1 import inference_pb2

TokenText = Callable[[int], str]


class ChoiceLogprobs:
    """One choice's logprobs: ``add`` each message's tokens, ``body`` the object for what was
    added since the last ``body`` (a stream chunk) or, with ``everything``, for all of them."""

    def __init__(self, kind: Literal["completion", "chat"], token_text: TokenText, text_offset: int = 0) -> None:
        self.kind = kind
        self.token_text = token_text
        self._entries: list[dict[str, Any]] = []
        self._sent = 0
        self._offset = text_offset  # completions: where the next token's text starts in the choice's text

    def add(self, token_ids: Sequence[int], logprobs: Sequence[inference_pb2.TokenLogprobs]) -> None:
        for token_id, entry in zip(token_ids, logprobs):
            text = self.token_text(token_id)
            top = [(self.token_text(t.token_id), t.logprob) for t in entry.top]
            self._entries.append({"token": text, "logprob": entry.logprob, "top": top, "offset": self._offset})
            self._offset += len(text)

    def body(self, everything: bool = False) -> dict[str, Any]:
        entries = self._entries if everything else self._entries[self._sent :]
        self._sent = len(self._entries)
        if self.kind == "chat":
            return {
                "content": [
                    {
                        "token": e["token"],
                        "logprob": e["logprob"],
                        "bytes": list(e["token"].encode()),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in e["top"]],
                    }
                    for e in entries
                ]
            }
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            # Two tokens of one text (lone bytes decode to "\ufffd") share a key: the likelier one stays.
            "top_logprobs": [{t: lp for t, lp in reversed(e["top"])} for e in entries],
            "text_offset": [e["offset"] for e in entries],
        }
