"""The simulated cluster: a frontend, a prefill pool and a decode pool, as discrete events.

Timings come from an ``EngineProfile``; the mechanics follow pdserve's workers:

- Arrival: the router sends a prompt shorter than ``local_prefill_threshold_tokens`` to the
  least-loaded decode worker (prefilled there), every other one to the prefill pool's queue.
- Prefill worker: when free, fills one step with up to ``prefill_chunk_size`` tokens: first
  the rest of the prompts it has started, then prompts taken first-come first-served from
  the pool's queue (the last one possibly in part: chunked prefill). The step takes
  ``prefill_seconds(tokens)``. A prompt's last chunk produces its first token (TTFT); its
  KV then moves to the least-loaded decode worker in ``kv_latency_s + bytes / bandwidth``.
- Decode worker: continuous batching. At each step start it admits waiting requests in
  arrival order while it runs fewer than ``decode_max_num_seqs`` and the KV cache can hold
  the request's whole context (a reservation: this model never preempts). A step decodes
  one token for every running request and adds local prefill chunks up to
  ``decode_max_num_batched_tokens`` in all; it takes ``decode_step_seconds(batch, context)``
  plus ``prefill_seconds(chunk tokens)``.
- Queues: the prefill pool shares one (the router's least-loaded choice, idealised: a
  prompt never waits at a busy worker while another is free); a decode worker is chosen
  when a prompt's KV is ready, and the request waits there for a slot (pinned: a replica
  added later cannot take it over).
- Replicas: a new one is ready ``startup_s`` after it is asked for; a removed one that is
  still starting is gone at once, a ready one drains (takes nothing new, finishes its
  work) and is then gone. Each holds a GPU from request to removal.

Per-step work is O(1) plus one heap operation per finishing request, so a half-hour trace
of a few dozen replicas runs in seconds.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.discovery.knobs import Knobs
from pdserve.planner.profile import EngineProfile
from sim.traces import TraceRequest


@dataclass(frozen=True)
class ClusterConfig:
    startup_s: float = 30.0  # request to ready: process start, weights, warm-up
    kv_bandwidth_bytes_per_s: float = 10e9
    kv_latency_s: float = 0.002
    # GPUs each replica holds: the ranks of its group (tensor x data parallel). The planner
    # scales replicas; the GPU accounting counts replicas x ranks.
    prefill_ranks: int = 1
    decode_ranks: int = 1


@dataclass(eq=False)
class SimRequest:
    spec: TraceRequest
    prefill_left: int  # prompt tokens still to compute
    first_token_s: float | None = None


class Samples:
    """What the cluster measured since the simulator last swapped this out: the frontend's
    view of one interval."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []  # per finished request: its mean gap between tokens
        self.e2e: list[float] = []
        self.outputs: list[int] = []


@dataclass(eq=False)
class _Worker:
    requested_s: float  # from here on it holds a GPU
    ready_s: float
    gone_s: float | None = None
    draining: bool = False
    busy: bool = False

    def is_ready(self, now: float) -> bool:
        return self.gone_s is None and not self.draining and self.ready_s <= now


@dataclass(eq=False)
class _PrefillWorker(_Worker):
    started: deque[SimRequest] = field(default_factory=deque)  # prompts begun, in order


@dataclass(eq=False)
class _DecodeWorker(_Worker):
    waiting: deque[SimRequest] = field(default_factory=deque)
    prefilling: list[SimRequest] = field(default_factory=list)  # local prompts admitted
    num_decoding: int = 0
    context_tokens: int = 0  # summed over the decoding requests
    kv_reserved: int = 0
    steps: int = 0
    finishing: list[tuple[int, int, SimRequest]] = field(default_factory=list)  # (last step, seq, request)

    @property
    def load(self) -> int:
        return self.num_decoding + len(self.prefilling) + len(self.waiting)


class Cluster:
    """The event loop and both pools; ``run_until`` advances simulated time."""

    def __init__(
        self, profile: EngineProfile, config: ClusterConfig, knobs: Knobs, *, prefill: int, decode: int
    ) -> None:
        self.profile = profile
        self.config = config
        self.knobs = knobs
        self.now = 0.0
        self.samples = Samples()
        self.prefill_queue: deque[SimRequest] = deque()
        self.prefill_workers: list[_PrefillWorker] = []
        self.decode_workers: list[_DecodeWorker] = []
        self._unassigned: deque[SimRequest] = deque()  # KV ready, no decode worker ready yet
        self._events: list[tuple[float, int, Callable[..., None], object]] = []
        self._seq = itertools.count()
        self.scale(prefill, decode, startup_s=0.0)

    # -- time ---------------------------------------------------------------------------

    def _at(self, time: float, action: Callable[..., None], arg: object = None) -> None:
        heapq.heappush(self._events, (time, next(self._seq), action, arg))

    def run_until(self, time: float) -> None:
        while self._events and self._events[0][0] <= time:
            self.now, _, action, arg = heapq.heappop(self._events)
            action(arg)
        self.now = time

    # -- pools ------------------------------------------------------------------------------

    def scale(self, prefill: int, decode: int, startup_s: float | None = None) -> None:
        """Resize both pools to ``prefill`` and ``decode`` replicas (ready or starting)."""
        delay = self.config.startup_s if startup_s is None else startup_s
        for workers, target, make in (
            (self.prefill_workers, prefill, _PrefillWorker),
            (self.decode_workers, decode, _DecodeWorker),
        ):
            active = [w for w in workers if w.gone_s is None and not w.draining]
            for _ in range(target - len(active)):
                worker = make(self.now, self.now + delay)
                workers.append(worker)
                self._at(worker.ready_s, self._on_ready, worker)
            surplus = max(len(active) - target, 0)
            # The newest starting replicas go first (they hold no work), then the least loaded
            # ready ones drain.
            starting = sorted((w for w in active if w.ready_s > self.now), key=lambda w: -w.ready_s)
            for worker in starting[:surplus]:
                worker.gone_s = self.now
            idle_first = sorted((w for w in active if w.ready_s <= self.now), key=self._work_of)
            for worker in idle_first[: max(surplus - len(starting), 0)]:
                worker.draining = True
                self._maybe_gone(worker)

    def _work_of(self, worker: _Worker) -> int:
        if isinstance(worker, _DecodeWorker):
            return worker.load
        return len(worker.started) + worker.busy

    def _maybe_gone(self, worker: _Worker) -> None:
        if worker.draining and worker.gone_s is None and not worker.busy and not self._work_of(worker):
            worker.gone_s = self.now

    def _on_ready(self, worker: _Worker) -> None:
        if worker.gone_s is not None:
            return  # removed while starting
        if isinstance(worker, _DecodeWorker):
            while self._unassigned:
                self._send_to_decode(self._unassigned.popleft())
            self._kick_decode(worker)
        else:
            self._kick_prefill(worker)

    def ready_count(self) -> tuple[int, int]:
        return (
            sum(w.is_ready(self.now) for w in self.prefill_workers),
            sum(w.is_ready(self.now) for w in self.decode_workers),
        )

    def waiting_for_first_token(self) -> list[SimRequest]:
        """Requests whose prompt is not computed yet, wherever they wait."""
        waiting = list(self.prefill_queue)
        for worker in self.prefill_workers:
            waiting.extend(worker.started)
        for worker in self.decode_workers:
            waiting.extend(r for r in worker.waiting if r.prefill_left)
            waiting.extend(worker.prefilling)
        return waiting

    def decoding(self) -> list[SimRequest]:
        """Requests with a first token and more to come (KV in flight excepted)."""
        requests = list(self._unassigned)
        for worker in self.decode_workers:
            requests.extend(r for r in worker.waiting if not r.prefill_left)
            requests.extend(request for _, _, request in worker.finishing)
        return requests

    # -- requests ---------------------------------------------------------------------------

    def arrive(self, spec: TraceRequest) -> None:
        request = SimRequest(spec, prefill_left=spec.prompt_tokens)
        if spec.prompt_tokens < self.knobs.local_prefill_threshold_tokens and self._least_loaded_decode():
            self._send_to_decode(request)
            return
        self.prefill_queue.append(request)
        for worker in self.prefill_workers:
            if not self.prefill_queue:
                break
            self._kick_prefill(worker)

    def _least_loaded_decode(self) -> _DecodeWorker | None:
        ready = [w for w in self.decode_workers if w.is_ready(self.now)]
        return min(ready, key=lambda w: w.load) if ready else None

    def _send_to_decode(self, request: SimRequest) -> None:
        worker = self._least_loaded_decode()
        if worker is None:
            self._unassigned.append(request)
            return
        worker.waiting.append(request)
        self._kick_decode(worker)

    # -- prefill ----------------------------------------------------------------------------

    def _kick_prefill(self, worker: _PrefillWorker) -> None:
        if worker.busy or worker.gone_s is not None or worker.ready_s > self.now:
            return
        budget = self.knobs.prefill_chunk_size
        chunks: list[tuple[SimRequest, int]] = []
        for request in worker.started:
            if budget == 0:
                break
            take = min(request.prefill_left, budget)
            chunks.append((request, take))
            budget -= take
        while budget > 0 and self.prefill_queue and not worker.draining:
            request = self.prefill_queue.popleft()
            worker.started.append(request)
            take = min(request.prefill_left, budget)
            chunks.append((request, take))
            budget -= take
        if not chunks:
            self._maybe_gone(worker)
            return
        worker.busy = True
        tokens = self.knobs.prefill_chunk_size - budget
        self._at(self.now + self.profile.prefill_seconds(tokens), self._prefill_done, (worker, chunks))

    def _prefill_done(self, arg: tuple[_PrefillWorker, list[tuple[SimRequest, int]]]) -> None:
        worker, chunks = arg
        worker.busy = False
        for request, take in chunks:
            request.prefill_left -= take
            if request.prefill_left == 0:
                worker.started.remove(request)
                self._first_token(request)
                if request.spec.output_tokens > 1:
                    nbytes = request.spec.prompt_tokens * self.profile.kv_bytes_per_token
                    delay = self.config.kv_latency_s + nbytes / self.config.kv_bandwidth_bytes_per_s
                    self._at(self.now + delay, self._send_to_decode, request)
        self._kick_prefill(worker)

    def _first_token(self, request: SimRequest) -> None:
        request.first_token_s = self.now
        self.samples.ttft.append(self.now - request.spec.arrival_s)
        if request.spec.output_tokens == 1:
            self._finished(request)

    def _finished(self, request: SimRequest) -> None:
        spec = request.spec
        self.samples.e2e.append(self.now - spec.arrival_s)
        self.samples.outputs.append(spec.output_tokens)
        if spec.output_tokens > 1:
            self.samples.itl.append((self.now - request.first_token_s) / (spec.output_tokens - 1))

    # -- decode -----------------------------------------------------------------------------

    def _kick_decode(self, worker: _DecodeWorker) -> None:
        if worker.busy or worker.gone_s is not None or worker.ready_s > self.now:
            return
        knobs, capacity = self.knobs, self.profile.kv_capacity_tokens
        while worker.waiting and worker.num_decoding + len(worker.prefilling) < knobs.decode_max_num_seqs:
            request = worker.waiting[0]
            need = request.spec.prompt_tokens + request.spec.output_tokens
            if worker.kv_reserved + need > capacity and worker.kv_reserved > 0:
                break
            worker.waiting.popleft()
            worker.kv_reserved += need
            if request.prefill_left:
                worker.prefilling.append(request)
            else:
                self._join_decode(worker, request)
        budget = knobs.decode_max_num_batched_tokens - worker.num_decoding
        chunks = []
        for request in worker.prefilling:
            if budget <= 0:
                break
            take = min(request.prefill_left, budget)
            chunks.append((request, take))
            budget -= take
        if not worker.num_decoding and not chunks:
            self._maybe_gone(worker)
            return
        worker.busy = True
        seconds = self.profile.decode_step_seconds(worker.num_decoding, worker.context_tokens)
        seconds += self.profile.prefill_seconds(sum(take for _, take in chunks))
        self._at(self.now + seconds, self._decode_done, (worker, worker.num_decoding, chunks))

    def _join_decode(self, worker: _DecodeWorker, request: SimRequest) -> None:
        """``request`` decodes from the worker's next step until its last token."""
        worker.num_decoding += 1
        worker.context_tokens += request.spec.prompt_tokens + 1
        last_step = worker.steps + request.spec.output_tokens - 2  # the first token came with the prompt
        heapq.heappush(worker.finishing, (last_step, next(self._seq), request))

    def _decode_done(self, arg: tuple[_DecodeWorker, int, list[tuple[SimRequest, int]]]) -> None:
        worker, num_decoding, chunks = arg
        worker.busy = False
        worker.context_tokens += num_decoding
        finishing = worker.finishing
        while finishing and finishing[0][0] <= worker.steps:
            _, _, request = heapq.heappop(finishing)
            worker.num_decoding -= 1
            worker.context_tokens -= request.spec.prompt_tokens + request.spec.output_tokens
            worker.kv_reserved -= request.spec.prompt_tokens + request.spec.output_tokens
            self._finished(request)
        worker.steps += 1
        for request, take in chunks:
            request.prefill_left -= take
            if request.prefill_left == 0:
                worker.prefilling.remove(request)
                self._first_token(request)
                if request.spec.output_tokens > 1:
                    self._join_decode(worker, request)
                else:
                    worker.kv_reserved -= request.spec.prompt_tokens + request.spec.output_tokens
        self._kick_decode(worker)
