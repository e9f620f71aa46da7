"""The benches' load generator: the workload and the gRPC client that times each request.

One ``grpc.aio`` channel carries every request as its own ``Generate`` stream, each with a
deadline; a stream's failure is recorded in its result, never raised. The variants:
- open loop (``open_loop``): arrivals at given offsets, a Poisson process drawn once from the
  seed (``poisson_arrivals``), so two deployments get the same requests at the same offsets;
- closed loop (``closed_loop``): that many lanes each send their next request when the
  previous one ends; fixed streams are a closed loop as wide as its requests;
- lanes of their own (``run_lanes``): each lane its own sequence of requests, e.g. drawn until
  a time (``requests_until``) from a seed of its own;
- long prompts: a ``WorkloadSpec`` whose ``prompt_len`` range is long.
A prompt is token ids or text. With ``hang_grace_s`` a stream still open that long past its
deadline is given up as ``HUNG``.

Timing, on the client, from the moment the call is issued:
- TTFT: until the first message that carries a token.
- ITL: each later token-carrying message's gap since the previous one, split evenly among the
  tokens it carries (a message may carry several); the tokens that arrive with the first
  message beyond its first have no gap of their own and are not counted.
- E2E: until the final message.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.v1 import inference_pb2, inference_pb2_grpc

FIRST_TOKEN_ID = 3  # random prompts skip the usual special ids 0, 1, 2


@dataclass(frozen=True)
class WorkloadSpec:
    """Attributes:
    num_requests: measured requests; num_warmup more run before them and are not measured.
    prompt_len / output_len: inclusive uniform ranges, tokens.
    shared_prefix_fraction: the share of requests that start with one of ``num_prefixes``
      shared prefixes of ``prefix_len`` tokens; their own tokens follow, so that their total
      length is the drawn length, but never less than prefix_len + 1.
    """

    num_requests: int
    num_warmup: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    shared_prefix_fraction: float = 0.0
    prefix_len: int = 256
    num_prefixes: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_len", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be LOW:HIGH with 1 <= LOW <= HIGH, got {low}:{high}")
        if self.num_requests < 1 or self.num_warmup < 0:
            raise ValueError("need num_requests >= 1 and num_warmup >= 0")
        if not 0.0 <= self.shared_prefix_fraction <= 1.0:
            raise ValueError(f"shared_prefix_fraction must be in [0, 1], got {self.shared_prefix_fraction}")
        if self.prefix_len < 1 or self.num_prefixes < 1:
            raise ValueError("need prefix_len >= 1 and num_prefixes >= 1")

    @property
    def longest_prompt(self) -> int:
        shared = self.prefix_len + 1 if self.shared_prefix_fraction > 0 else 0
        return max(self.prompt_len[1], shared)


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: list[int] | str  # token ids, or text the frontend tokenizes
    max_tokens: int
    shared_prefix: int | None = None  # which shared prefix it starts with

    def message(self, model: str, sampling: SamplingSpec) -> inference_pb2.GenerateRequest:
        """The ``Generate`` call: greedy unless ``sampling.temperature``, with ``ignore_eos``."""
        options = inference_pb2.SamplingOptions(
            max_tokens=self.max_tokens, temperature=sampling.temperature, ignore_eos=True
        )
        if sampling.temperature > 0:
            options.seed = sampling.seed + self.index
        prompt = (
            {"text": self.prompt}
            if isinstance(self.prompt, str)
            else {"token_ids": inference_pb2.TokenIds(ids=self.prompt)}
        )
        return inference_pb2.GenerateRequest(
            model=model, sampling=options, request_id=f"bench-{self.index}-{uuid.uuid4().hex[:8]}", **prompt
        )


def make_requests(spec: WorkloadSpec, vocab_size: int) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(warm-up, measured) requests of random token ids; the warm-up ones share nothing with the rest."""
    rng = random.Random(spec.seed)
    prefixes = [
        [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(spec.prefix_len)] for _ in range(spec.num_prefixes)
    ]

    def draw(index: int, rng: random.Random, shared: bool) -> BenchRequest:
        length = rng.randint(*spec.prompt_len)
        max_tokens = rng.randint(*spec.output_len)
        prefix_id = rng.randrange(spec.num_prefixes) if shared and rng.random() < spec.shared_prefix_fraction else None
        head = prefixes[prefix_id] if prefix_id is not None else []
        tail = [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(max(length - len(head), 1))]
        return BenchRequest(index, head + tail, max_tokens, prefix_id)

    measured = [draw(i, rng, True) for i in range(spec.num_requests)]
    warm_rng = random.Random(spec.seed + 1_000_003)
    warmup = [draw(-1 - i, warm_rng, False) for i in range(spec.num_warmup)]
    # Warm-ups need two tokens at least, so that the decode side runs after a KV transfer.
    warmup = [BenchRequest(r.index, r.prompt, max(2, min(r.max_tokens, 8)), None) for r in warmup]
    return warmup, measured


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Offsets in seconds from the start: exponential gaps of mean 1/rate; the first at 0."""
    rng = random.Random(seed + 7)
    offsets, now = [], 0.0
    for _ in range(num):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 0.0
    seed: int = 0  # request i samples with seed + i (only matters when temperature > 0)
    timeout_s: float = 300.0  # every call's deadline
    hang_grace_s: float | None = None  # given up as HUNG this long past the deadline (None: never)


@dataclass
class RequestResult:
    index: int
    sent_at: float  # perf_counter seconds
    send_lag_ms: float | None = None  # open loop: how late after its scheduled arrival it was sent
    ttft_ms: float | None = None
    itls_ms: list[float] = field(default_factory=list)
    first_gap_ms: float | None = None  # first to second token-carrying message, whole
    e2e_ms: float | None = None
    ended_at: float | None = None
    num_tokens: int = 0
    num_messages: int = 0
    max_tokens_per_message: int = 0
    error: str | None = None  # a gRPC status code name, NO_FINAL, or HUNG
    detail: str = ""  # the error's message
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: dict[str, int] = field(default_factory=dict)
    breakdown: dict[str, Any] = field(default_factory=dict)
    migration_history: list[tuple[str, str, int]] = field(default_factory=list)  # (from, to, tokens streamed)
    _last_at: float | None = None

    def on_message(self, now: float, num_tokens: int) -> None:
        """A stream message arrived at ``now`` (perf_counter seconds) carrying ``num_tokens`` tokens."""
        self.num_messages += 1
        if not num_tokens:
            return
        self.num_tokens += num_tokens
        self.max_tokens_per_message = max(self.max_tokens_per_message, num_tokens)
        if self._last_at is None:
            self.ttft_ms = (now - self.sent_at) * 1e3
        else:
            gap_ms = (now - self._last_at) * 1e3
            if self.first_gap_ms is None:
                self.first_gap_ms = gap_ms
            self.itls_ms += [gap_ms / num_tokens] * num_tokens
        self._last_at = now


async def generate(
    stub: Any, model: str, request: BenchRequest, sampling: SamplingSpec, scheduled_at: float | None = None
) -> RequestResult:
    """Send one request and time its stream; failures are recorded, never raised."""
    message = request.message(model, sampling)
    sent = time.perf_counter()
    result = RequestResult(request.index, sent)
    if scheduled_at is not None:
        result.send_lag_ms = (sent - scheduled_at) * 1e3
    final = None
    give_up_s = None if sampling.hang_grace_s is None else sampling.timeout_s + sampling.hang_grace_s
    try:
        async with asyncio.timeout(give_up_s):
            async for response in stub.Generate(message, timeout=sampling.timeout_s):
                result.on_message(time.perf_counter(), len(response.token_ids))
                result.token_ids += response.token_ids
                if response.HasField("final"):
                    final = response.final
    except TimeoutError:
        result.error, result.detail = "HUNG", f"open {give_up_s:g} s after it was sent"
    except grpc.aio.AioRpcError as exc:
        result.error, result.detail = exc.code().name, exc.details() or ""
    result.ended_at = time.perf_counter()
    if result.error is None and final is None:
        result.error = "NO_FINAL"
    if final is not None:
        result.e2e_ms = (result.ended_at - sent) * 1e3
        result.finish_reason = final.finish_reason
        u, b = final.usage, final.breakdown
        result.usage = {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "cached_prompt_tokens": u.cached_prompt_tokens,
        }
        result.breakdown = {
            "disaggregated": b.disaggregated,
            "queue_ms": b.queue_ms,
            "prefill_ms": b.prefill_ms,
            "kv_transfer_ms": b.kv_transfer_ms,
            "kv_transfer_bytes": b.kv_transfer_bytes,
            "ttft_ms": b.ttft_ms,
            "e2e_ms": b.e2e_ms,
            "prefill_attempts": b.prefill_attempts,
            "migrations": b.migrations,
        }
        result.migration_history = [(m.from_worker, m.to_worker, m.tokens_streamed) for m in b.migration_history]
    return result


@contextlib.asynccontextmanager
async def inference_stub(target: str) -> AsyncIterator[inference_pb2_grpc.InferenceStub]:
    """An ``Inference`` stub on a channel of its own to ``target`` (HOST:PORT), closed on exit."""
    async with grpc.aio.insecure_channel(target) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


async def list_models(target: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    async with inference_stub(target) as stub:
        response = await stub.ListModels(inference_pb2.ListModelsRequest(), timeout=timeout_s)
    return [
        {
            "name": m.name,
            "max_model_len": m.max_model_len,
            "vocab_size": m.vocab_size,
            "prefill_workers": m.prefill_workers,
            "decode_workers": m.decode_workers,
        }
        for m in response.models
    ]


async def run_load(
    target: str,
    model: str,
    warmup: list[BenchRequest],
    requests: list[BenchRequest],
    sampling: SamplingSpec,
    *,
    arrivals: list[float] | None,
    concurrency: int | None,
    warmup_concurrency: int,
) -> tuple[list[RequestResult], float, Counter]:
    """Warm up (closed loop), then the measured load: open loop at ``arrivals`` (offsets in
    seconds) or closed loop at ``concurrency``. Returns the results, the measured duration in
    seconds (first send to last end) and the warm-up's errors."""
    async with inference_stub(target) as stub:
        warm = await closed_loop(stub, model, warmup, sampling, max(1, warmup_concurrency))
        warm_errors = Counter(r.error for r in warm if r.error)
        if warmup and len(warm_errors) and sum(warm_errors.values()) == len(warmup):
            raise RuntimeError(f"every warm-up request failed: {dict(warm_errors)}")
        started = time.perf_counter()
        if arrivals is not None:
            results = await open_loop(stub, model, requests, sampling, arrivals)
        else:
            assert concurrency is not None
            results = await closed_loop(stub, model, requests, sampling, concurrency)
    ended = max((r.ended_at or started) for r in results)
    return results, ended - started, warm_errors


async def open_loop(
    stub: Any, model: str, requests: list[BenchRequest], sampling: SamplingSpec, offsets: list[float]
) -> list[RequestResult]:
    start = time.perf_counter()
    tasks = []
    for request, offset in zip(requests, offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(generate(stub, model, request, sampling, scheduled_at=start + offset)))
    return list(await asyncio.gather(*tasks))


async def closed_loop(
    stub: Any, model: str, requests: list[BenchRequest], sampling: SamplingSpec, concurrency: int
) -> list[RequestResult]:
    pending = iter(requests)  # shared by the lanes: one event loop, no races
    results = await run_lanes(stub, model, [pending] * min(concurrency, len(requests)), sampling)
    return sorted(results, key=lambda r: r.index)


async def run_lanes(
    stub: Any, model: str, lanes: list[Iterable[BenchRequest]], sampling: SamplingSpec
) -> list[RequestResult]:
    """Every lane at once, each sending its requests one after another; results as they end."""
    results: list[RequestResult] = []

    async def lane(requests: Iterable[BenchRequest]) -> None:
        for request in requests:
            results.append(await generate(stub, model, request, sampling))

    await asyncio.gather(*(lane(requests) for requests in lanes))
    return results


def requests_until(deadline: float, draw: Callable[[], BenchRequest]) -> Iterator[BenchRequest]:
    """``draw()`` again and again until ``time.perf_counter()`` passes ``deadline``."""
    while time.perf_counter() < deadline:
        yield draw()
