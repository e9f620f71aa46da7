"""What a request's final message says about its way through the workers: the latency
breakdown, the prompt tokens found cached, and when the client got each message's tokens
(the inter-token latencies the frontend's metrics observe)."""

from __future__ import annotations

import time

from pdserve.v1 import inference_pb2, worker_pb2


class FlowReport:
    """Kept by one ``RequestFlow``. The prefill and start figures describe the request's first
    attempt; the decode worker, the migrations and the end-to-end time its whole way."""

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.breakdown = inference_pb2.LatencyBreakdown()
        self._cached_tokens = 0  # prompt tokens the prompt's worker found in its prefix cache
        self._token_times: list[tuple[float, int]] = []  # (when, how many tokens) per message

    def streamed(self, num_tokens: int) -> None:
        """A message with ``num_tokens`` tokens goes to the client now."""
        self._token_times.append((time.monotonic(), num_tokens))

    def first_token(self) -> None:
        """The client gets its first token now (a no-op after the first time)."""
        if not self.breakdown.ttft_ms:
            self.breakdown.ttft_ms = (time.monotonic() - self.arrival) * 1e3

    def prefilled(self, response: worker_pb2.PrefillResponse, attempt: int, sent_at: float) -> None:
        """The first attempt's prompt was computed on a prefill worker (its ``attempt``-th try)."""
        b = self.breakdown
        b.disaggregated = True
        b.prefill_worker = response.worker_id
        b.prefill_attempts = attempt
        b.queue_ms = (sent_at - self.arrival) * 1e3 + response.queue_ms
        b.prefill_ms = response.prefill_ms
        self._cached_tokens = response.num_cached_tokens

    def decode_started(self, started: worker_pb2.DecodeStarted, sent_at: float) -> None:
        """The first attempt's decode worker began: after its pull, or with the prompt computed there."""
        b = self.breakdown
        b.kv_transfer_ms = started.kv_transfer_ms
        b.kv_transfer_bytes = started.kv_transfer_bytes
        if not b.disaggregated:
            b.queue_ms = (sent_at - self.arrival) * 1e3 + started.queue_ms
            b.prefill_ms = started.prefill_ms
            self._cached_tokens = started.num_cached_tokens

    def migrated(self, migration: inference_pb2.Migration) -> None:
        self.breakdown.migration_history.append(migration)
        self.breakdown.migrations += 1

    def finish(self, message: inference_pb2.GenerateResponse, decode_worker_id: str, prompt_tokens: int) -> None:
        """Put the usage and the breakdown in the final ``message`` (its decode worker, if any)."""
        b = self.breakdown
        if decode_worker_id:
            b.decode_worker = decode_worker_id
            if not b.prefill_worker:
                b.prefill_worker = decode_worker_id
        b.e2e_ms = (time.monotonic() - self.arrival) * 1e3
        if not b.ttft_ms:
            b.ttft_ms = b.e2e_ms
        message.final.usage.prompt_tokens = prompt_tokens
        message.final.usage.cached_prompt_tokens = self._cached_tokens
        message.final.breakdown.CopyFrom(b)

    def token_gaps(self) -> list[float]:
        """Inter-token latencies in seconds: a message of n tokens after a gap counts n gaps of gap/n."""
        gaps: list[float] = []
        for (before, _), (at, count) in zip(self._token_times, self._token_times[1:]):
            gaps += [(at - before) / count] * count
        return gaps
