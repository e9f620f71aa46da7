"""Streaming token ids -> text deltas, with stop strings, never emitting half a character."""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.text.tokenizer import Tokenizer

# What a byte-level decoder yields for an incomplete UTF-8 sequence.
_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output, so the first output token is decoded in context
# (sentencepiece drops the leading space of the first token of a decode; vLLM uses 5 too).
_NUM_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, one token at a time.

    Each `add` decodes a small window: the tokens already turned into text (the prefix, kept
    for context) plus the tokens not yet turned into text. The new text is what the window
    decodes to beyond the prefix. It is held back while it ends in U+FFFD, since that means a
    multi-byte character is split across tokens still to come.

    Without a stop string, the deltas of `add` followed by `flush()` join to
    `tokenizer.decode(output_ids)` (for a byte-level tokenizer; for sentencepiece the first
    delta keeps the leading space that continues the prompt), except that a U+FFFD at the very
    end is dropped, since there it is a character the output stopped in the middle of.

    With stop strings, the text is cut right before the earliest stop string found and nothing
    from it on is emitted; the trailing characters that could begin a stop string are held back
    until the next tokens show whether they do.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop or [])
        if any(not s for s in self._stop):
            raise ValueError("stop strings must be non-empty")
        self._max_stop_len = max((len(s) for s in self._stop), default=0)

        # The decode window: `_window[:_num_prefix]` is already text, the rest is pending.
        self._window = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        self._num_prefix = len(self._window)
        self._prefix_text = self._decode(self._window)

        self._text = ""  # output text decoded so far, cut before a stop string once one is seen
        self._num_emitted = 0  # characters of `_text` returned to the caller
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been seen; later tokens are ignored."""
        return self._stopped

    @property
    def text(self) -> str:
        """All text emitted so far (never the stop string or anything after it)."""
        return self._text[: self._num_emitted]

    def add(self, token_id: int) -> str:
        """Take the next output token; return the text that is now safe to emit (maybe "")."""
        if self._stopped:
            return ""
        self._window.append(token_id)
        window_text = self._decode(self._window)
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""
        # The tokens just turned into text become the prefix for the next ones.
        del self._window[: self._num_prefix]
        self._num_prefix = len(self._window)
        delta = window_text[len(self._prefix_text) :]
        self._prefix_text = self._decode(self._window)
        return self._append(delta, is_final=False)

    def add_until_stop(self, token_ids: Iterable[int]) -> tuple[int, str]:
        """Take ``token_ids`` in order up to the one that completes a stop string, if one does.

        Returns how many tokens were taken (the stopping one included; none once stopped) and
        the text that is now safe to emit. Callers cut their token ids to the count, so that a
        client never gets tokens past the stop.
        """
        num_taken, text = 0, ""
        for token_id in token_ids:
            if self._stopped:
                break
            text += self.add(token_id)
            num_taken += 1
        return num_taken, text

    def flush(self) -> str:
        """At the end of the request, return all text still held back; call it once, last.

        A character left incomplete by the last tokens is dropped rather than emitted as U+FFFD.
        """
        if self._stopped:
            return ""
        pending = self._decode(self._window)[len(self._prefix_text) :].rstrip(_REPLACEMENT_CHAR)
        self._window.clear()
        self._num_prefix = 0
        self._prefix_text = ""
        return self._append(pending, is_final=True)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _append(self, delta: str, is_final: bool) -> str:
        """Add `delta` to the text, look for stop strings, and return what can be emitted."""
        num_old = len(self._text)
        self._text += delta
        stop_at = self._find_stop(num_old)
        if stop_at is not None:
            self._text = self._text[:stop_at]
            self._stopped = True
            return self._emit(stop_at)
        if is_final:
            return self._emit(len(self._text))
        return self._emit(len(self._text) - self._num_stop_prefix_chars())

    def _find_stop(self, num_old: int) -> int | None:
        """Start of the earliest stop string that ends in the text added after `num_old` chars."""
        # A stop string fully inside the old text was found earlier, so only this tail can hold
        # a new one.
        search_from = max(0, num_old - self._max_stop_len + 1)
        starts = [self._text.find(s, search_from) for s in self._stop]
        return min((i for i in starts if i >= 0), default=None)

    def _num_stop_prefix_chars(self) -> int:
        """Length of the longest tail of the text that is the start of some stop string."""
        for n in range(min(self._max_stop_len - 1, len(self._text)), 0, -1):
            tail = self._text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

    def _emit(self, end: int) -> str:
        # Holding back every possible stop-string start guarantees a stop is never found
        # inside text already emitted.
        assert end >= self._num_emitted, (end, self._num_emitted)
        delta = self._text[self._num_emitted : end]
        self._num_emitted = end
        return delta
