"""Continuous batching: which requests run this step, and with how many tokens.

Each step gives every running request the tokens that bring its computed length up to its
known length — one token for a decode, a chunk for a prompt — under a token budget and a
cap on running requests. Decodes are scheduled first so a long prompt never starves them;
prompts are chunked to what is left of the budget. When blocks run out, the most recently
arrived running request is preempted: its blocks are freed and it is recomputed later
(its generated tokens are kept). Waiting requests are admitted first-come first-served.
A finished PRODUCER request's blocks stay pinned for a peer (``pins``); each step first
frees the pins whose deadline passed.

Pure bookkeeping over ``KVCacheManager``: no tensors, no model.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.pins import BlockPins
from pdserve.engine.request import Request, RequestStatus
from pdserve.types.engine_config import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, check_step_limits


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        check_step_limits(self.max_num_seqs, self.max_num_batched_tokens)


@dataclass
class SchedulerOutput:
    # Requests to compute this step and their token counts; decodes (1 token) first.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    # Decode role: requests that got blocks this step and now wait for their prompt KV.
    awaiting_kv: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests the scheduler ended itself (e.g. a context that can never fit the cache).
    finished: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.awaiting_kv or self.finished)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.kv = kv
        self.pins = BlockPins(kv.free, clock=clock)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the tail is preempted first
        self.awaiting_kv: dict[str, Request] = {}
        # Consumers resumed since the last schedule: they may join the step under way.
        self.resumed: list[Request] = []
        self.num_preemptions = 0  # since start, for metrics and tests

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.awaiting_kv)

    def schedule(self) -> SchedulerOutput:
        self.pins.expire()
        self.resumed.clear()  # every running request is considered below
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        # Decodes first, then prompt chunks, each in admission order.
        for request in sorted(list(self.running), key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if request.status is not RequestStatus.RUNNING or budget == 0:
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._make_room(request, num_new, scheduled_ids, out):
                out.scheduled.append((request, num_new))
                scheduled_ids.add(request.request_id)
                budget -= num_new
        if not out.preempted:
            budget = self._admit_waiting(budget, out)
        return out

    def _make_room(self, request: Request, num_new: int, scheduled_ids: set[str], out: SchedulerOutput) -> bool:
        """Allocate blocks for ``num_new`` more tokens, preempting later arrivals if needed."""
        while not self.kv.allocate(request.request_id, request.num_computed_tokens + num_new):
            victims = [r for r in self.running if r.request_id not in scheduled_ids and r is not request]
            if victims:
                self._preempt(victims[-1], out)
                continue
            if len(self.running) == 1:
                # Alone and still too big: the cache can never hold this context.
                self._finish(request, "length")
                out.finished.append(request)
            else:
                self._preempt(request, out)
            return False
        return True

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        while self.waiting and budget > 0 and len(self.running) + len(self.awaiting_kv) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = self.kv.find_cached_prefix(request.token_ids, request.cache_salt)
            num_cached = len(cached) * self.kv.block_size
            if request.awaits_kv:
                if not self._hold_for_kv(request, cached):
                    break
                self.waiting.popleft()
                out.awaiting_kv.append(request)
                continue
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate(request.request_id, num_cached + num_new, cached):
                if self.kv.num_blocks_for(num_cached + num_new) > self.kv.pool.num_blocks:
                    self.waiting.popleft()  # can never fit: end it rather than block the queue
                    self._finish(request, "length")
                    out.finished.append(request)
                    continue
                break  # first-come first-served: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new
        return budget

    def admit_consumer(self, request: Request) -> bool:
        """Decode role: give a new CONSUMER its blocks now, between steps or while one runs.

        True: it awaits its KV (``awaiting_kv``) and its pull may start at once. False: no seat
        or no blocks now, or requests queue ahead of it (first-come first-served): it waits,
        and a later ``schedule`` admits it and lists it in ``SchedulerOutput.awaiting_kv``.
        """
        assert request.awaits_kv
        if not self.waiting and len(self.running) + len(self.awaiting_kv) < self.config.max_num_seqs:
            if self._hold_for_kv(request, self.kv.find_cached_prefix(request.token_ids, request.cache_salt)):
                return True
        self.waiting.append(request)
        return False

    def _hold_for_kv(self, request: Request, cached: list[int]) -> bool:
        """The KV (prompt, and any tokens it resumed with) comes from a peer: hold blocks for all
        of it, compute nothing."""
        if not self.kv.allocate(request.request_id, request.num_tokens, cached):
            return False
        request.num_computed_tokens = request.num_cached_tokens = len(cached) * self.kv.block_size
        request.status = RequestStatus.WAITING_FOR_KV
        self.awaiting_kv[request.request_id] = request
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def kv_received(self, request_id: str, first_token_id: int) -> Request:
        """Decode role: the prompt's KV is in our blocks; continue from the peer's first token."""
        request = self.awaiting_kv.pop(request_id)
        request.num_computed_tokens = request.num_tokens
        self.kv.cache_full_blocks(request_id, request.token_ids, request.num_computed_tokens, request.cache_salt)
        request.append_output(first_token_id, None)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.resumed.append(request)
        return request

    def take_resumed(self, room: int) -> list[Request]:
        """Consumers resumed since the last schedule that join the step under way: up to
        ``room``, each given a slot for its next token, in the order they were resumed.

        When blocks run short the rest wait for the next schedule, which may preempt for them.
        """
        taken: list[Request] = []
        while self.resumed and len(taken) < room:
            request = self.resumed.pop(0)
            if request.status is not RequestStatus.RUNNING or request.num_tokens - request.num_computed_tokens != 1:
                continue  # ended meanwhile
            if not self.kv.allocate(request.request_id, request.num_tokens):
                self.resumed.clear()
                break
            taken.append(request)
        return taken

    def finish(self, request: Request, reason: str, *, pin: bool = False) -> None:
        """End a request wherever it is; its blocks are freed, or pinned for a peer for ``request.pin_s``."""
        if request in self.running:
            self.running.remove(request)
        elif request.request_id in self.awaiting_kv:
            del self.awaiting_kv[request.request_id]
        elif request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, reason, pin=pin)

    def _finish(self, request: Request, reason: str, *, pin: bool = False) -> None:
        if request in self.running:
            self.running.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if pin:
            assert request.pin_s is not None, "a pinned request says for how long"
            self.pins.pin(request.request_id, request.pin_s)
        else:
            self.kv.free(request.request_id)
