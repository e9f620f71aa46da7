"""The engine: one step function, schedule → run → sample → update.

The engine knows nothing of worker roles. A request's ``KVRole`` is the only seam:
a PRODUCER (prefill worker) finishes after its first token with reason ``"kv_transfer"``
and its blocks pinned for the peer: the engine owns the pin and its deadline, ``pin_s``
after the finish, and frees the blocks once, at ``kv_sent`` (the peer is done with them),
``release_pin``, ``abort`` or the deadline (``BlockPins``). A CONSUMER (decode worker) is
admitted with blocks for its prompt and waits, listed in ``StepOutput.awaiting_kv``, until
``kv_received`` says the prompt's KV has been written into them.

The engine speaks token ids only. Text (detokenization and stop strings) belongs to whoever
turns its outputs into a completion: ``LLM`` offline, the frontend when serving; they end a
request at a stop string with ``abort``, and ``SamplingParams.stop`` is never read here. Stop
token ids and EOS are token-level, and the engine's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace

import llguidance

from pdserve.distributed.parallel_state import SINGLE_RANK, ParallelState
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.output import RequestOutput, StepOutput, banned_token_ids, request_output, stop_reason
from pdserve.engine.request import KVRole, Request
from pdserve.engine.request_limits import RequestLimits
from pdserve.engine.sampler import Sampler, SamplingRequest, make_generator, skip_draw
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.startup import WARM_UP_REQUEST_ID, eos_token_ids, kv_budget, warm_up_prompt
from pdserve.engine.step_plan import GroupStart
from pdserve.model.kv_cache import KVCache, KVCacheSpec
from pdserve.model.setup import setup_model
from pdserve.text.grammar import GrammarCompiler
from pdserve.text.tokenizer import find_tokenizer
from pdserve.types.engine_config import EngineConfig, check_step_limits
from pdserve.types.logprobs import Logprobs
from pdserve.types.sampling_params import SamplingParams
from pdserve.types.structured_output import StructuredOutput

logger = logging.getLogger("pdserve.engine")


class LLMEngine:
    """``clock`` times the pins' deadlines (tests pass their own)."""

    def __init__(
        self,
        model: str,
        config: EngineConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        parallel: ParallelState = SINGLE_RANK,
    ) -> None:
        """``parallel``: rank 0 of a tensor-parallel group (the other ranks run ``follow_steps``)
        or one data-parallel rank; a single rank by default."""
        self.config = config or EngineConfig()
        cfg = self.config
        self.parallel = parallel
        setup = setup_model(model, cfg, parallel)
        self.device, self.model_config, self.backend, self.model = (
            setup.device,
            setup.model_config,
            setup.backend,
            setup.model,
        )
        mc = self.model_config
        self.max_model_len = min(cfg.max_model_len or mc.max_model_len, mc.max_model_len)
        self.tokenizer = find_tokenizer(mc.path)
        self.eos_token_ids = eos_token_ids(mc, self.tokenizer)

        spec = setup.kv_spec
        num_blocks = spec.num_blocks_for(kv_budget(cfg, spec, self.device, mc.vocab_size, self.max_model_len))
        if parallel.tp_size > 1:
            parallel.plans.send(GroupStart(num_blocks=num_blocks))
        self.kv_cache = KVCache(spec, num_blocks, self.device)
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching=cfg.enable_prefix_caching)
        self.kv = KVCacheManager(self.block_pool, cfg.block_size)
        self.limits = RequestLimits(mc, self.tokenizer, self.max_model_len, self.kv)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len), self.kv, clock=clock
        )
        self.runner = ModelRunner(self.model, self.kv_cache, self.kv, self.device, parallel)
        self.sampler = Sampler(argmax=self.backend.argmax)
        self._requests: dict[str, Request] = {}
        self._grammars: GrammarCompiler | None = None  # made at the first structured request
        self._grammars_lock = threading.Lock()
        logger.info(
            "%s on %s (%s kernels): KV cache %d values/token/layer, %d bytes/token, %d blocks x %d tokens = %d tokens (%.1f MiB)",
            mc.architecture,
            self.device,
            self.backend.name,
            spec.values_per_token_per_layer,
            spec.bytes_per_token,
            num_blocks,
            cfg.block_size,
            num_blocks * cfg.block_size,
            self.kv_cache.nbytes / 2**20,
        )

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self.kv_cache.spec

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        kv_role: KVRole = KVRole.LOCAL,
        *,
        pin_s: float | None = None,
        generated_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request; raises ValueError for a prompt the engine cannot serve.

        A PRODUCER gives ``pin_s``: its blocks stay pinned for the peer that long at most.
        ``generated_token_ids`` resumes a request begun elsewhere (a migrated one): they are
        its first output tokens, computed here with the prompt (or pulled, as a CONSUMER), and
        count as output for ``max_tokens`` and the penalties; a seeded request's generator
        skips the draws they took, so it goes on with the tokens it would have drawn there.
        ``arrival_time`` (``time.monotonic``): when the caller received it, if before now (an
        engine loop's request waits for the step under way); its queue time counts from there.
        ``cache_salt``: the request shares prefix-cache blocks only with requests of the same salt.
        """
        request = self._new_request(request_id, prompt, params, kv_role, pin_s, generated_token_ids, cache_salt)
        if arrival_time is not None:
            request.arrival_time = min(arrival_time, request.arrival_time)
        self.scheduler.add(request)
        return request

    def _new_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        kv_role: KVRole,
        pin_s: float | None,
        generated_token_ids: list[int] | None,
        cache_salt: str | None = None,
    ) -> Request:
        if request_id in self._requests or request_id in self.scheduler.pins:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if kv_role is KVRole.PRODUCER and not (pin_s is not None and pin_s > 0):
            raise ValueError(f"a producer request needs pin_s > 0, got {pin_s!r}")
        token_ids = self.limits.prompt_token_ids(prompt)
        generated = self.limits.generated_token_ids(token_ids, generated_token_ids or [], params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            generator=make_generator(params.seed, self.device),
            kv_role=kv_role,
            pin_s=pin_s,
            cache_salt=cache_salt or None,
            matcher=None if params.structured is None else self.compile_grammar(params.structured).deep_copy(),
        )
        request.resume(generated)  # replays the grammar over them: a hand-off or migration goes on from there
        if request.generator is not None and not params.is_greedy:
            for _ in generated:
                skip_draw(request.generator, self.model_config.vocab_size)
        self._requests[request_id] = request
        return request

    def admit_consumer(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        generated_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> tuple[list[int], int] | None:
        """Decode role: queue a CONSUMER and give it blocks at once, outside any step.

        Returns its block ids and the prompt tokens already in this engine's prefix cache when
        it got them, so its pull can start now; None when it waits for a seat or blocks (a later
        step lists it in ``StepOutput.awaiting_kv``). Raises ValueError like ``add_request``, and
        takes its ``generated_token_ids`` and ``cache_salt`` too.
        """
        request = self._new_request(request_id, prompt, params, KVRole.CONSUMER, None, generated_token_ids, cache_salt)
        if not self.scheduler.admit_consumer(request):
            return None
        request.first_scheduled_time = time.monotonic()
        return list(self.kv.block_table(request_id)), request.num_cached_tokens

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> None:
        """Raise the ValueError ``add_request`` would for this prompt, without adding it."""
        self.limits.generated_token_ids(self.limits.prompt_token_ids(prompt), [], params)
        if params.structured is not None:
            self.compile_grammar(params.structured)

    def compile_grammar(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """``spec`` compiled for this model, at its start (shared: copy it), from a bounded
        cache; callable from any thread, so a server compiles off its event loop and outside
        the step. Raises ValueError naming the problem, or for a model without a tokenizer."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError(f"structured: model {self.model_config.path} has no tokenizer.json")
                self._grammars = GrammarCompiler(
                    self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids)
                )
        return self._grammars.compile(spec)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request at any point and free everything it holds, its pin included."""
        if self.scheduler.pins.release(request_id):
            return None
        request = self._requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, "abort")
        return self._finish_output(request, [])

    def kv_sent(self, request_id: str) -> None:
        """Prefill role: the peer is done with the request's pinned blocks (it has the KV, or
        gave up): free them. A report that comes before the pin frees it as it is made."""
        self.scheduler.pins.sent(request_id)

    def release_pin(self, request_id: str) -> bool:
        """Prefill role: nobody will pull; free the pin if it is still there (False: it was not)."""
        return self.scheduler.pins.release(request_id)

    def release_pins(self) -> None:
        """Free every pin (the engine stops serving)."""
        self.scheduler.pins.release_all()

    @property
    def num_held(self) -> int:
        """Producer requests whose blocks are pinned for a peer."""
        return len(self.scheduler.pins)

    def seconds_to_next_deadline(self) -> float | None:
        """How soon a step has a pin to free at its deadline (None: nothing is pinned).

        The engine loop steps by then even when nothing runs.
        """
        deadline = self.scheduler.pins.next_deadline
        return None if deadline is None else max(deadline - self.scheduler.pins.clock(), 0.0)

    def kv_received(self, request_id: str, first_token_id: int) -> RequestOutput | None:
        """Decode role: the prompt's KV is in the request's blocks; decode on from ``first_token_id``.

        Returns the request's final output when that first token already ends it (a stop
        token, or ``max_tokens`` of 1), else None. ``first_token_id`` becomes the request's first
        output token: in ``token_ids`` from now on, and in the ``new_token_ids`` of a final
        output returned here (a caller that already has it skips it).
        """
        request = self.scheduler.kv_received(request_id, first_token_id)
        if request.generator is not None and not request.params.is_greedy:
            skip_draw(request.generator, self.model_config.vocab_size)
        reason = stop_reason(request, first_token_id, self.max_model_len)
        if reason is None:
            return None
        self.scheduler.finish(request, reason)
        return self._finish_output(request, [first_token_id])

    def retune(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Change the scheduler's limits from the next step on (live knobs).

        Neither may exceed the start-up value: memory was reserved for that step size.
        Requests already running above a lowered ``max_num_seqs`` finish; only admission waits.
        """
        cfg = self.config
        check_step_limits(max_num_seqs, max_num_batched_tokens)
        if max_num_seqs > cfg.max_num_seqs:
            raise ValueError(
                f"max_num_seqs must be in [1, {cfg.max_num_seqs}] (the start-up value), got {max_num_seqs}"
            )
        if max_num_batched_tokens > cfg.max_num_batched_tokens:
            raise ValueError(
                f"max_num_batched_tokens must be in [max_num_seqs={max_num_seqs}, {cfg.max_num_batched_tokens}] "
                f"(the start-up value), got {max_num_batched_tokens}"
            )
        self.scheduler.config = replace(
            self.scheduler.config, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        )

    def warm_up(self) -> None:
        """Run one short prompt and one decode step through the model, so that the first
        request does not pay for what a process's first model run sets up: the thread pool,
        the GEMM library's kernels, first-touch memory (on CPU, ~20 ms of a 440-token prompt).

        For an idle single-rank engine (a group's ranks step together: they are not warmed
        here). The prompt's full blocks stay in the prefix cache, free to evict like any."""
        if self.parallel.world_size > 1 or self.has_unfinished():
            return
        prompt = warm_up_prompt(
            self.max_model_len, self.block_pool.num_blocks, self.config.block_size, self.model_config.vocab_size
        )
        if prompt is None:
            return
        self.add_request(WARM_UP_REQUEST_ID, prompt, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0))
        while self.has_unfinished():
            self.step()

    def has_unfinished(self) -> bool:
        return self.scheduler.num_requests > 0

    # -- the step -----------------------------------------------------------------------------

    def step(
        self,
        while_running: AbstractContextManager[object] | None = None,
        mid_step: AbstractContextManager[object] | None = None,
    ) -> StepOutput:
        """Schedule, run the model, sample, update.

        ``while_running`` is entered around the model run alone (``EngineLoop`` releases its
        lock there, so that consumers are admitted and resumed while the model runs). With
        ``mid_step`` (``EngineLoop`` passes its lock), consumers resumed while the model runs
        join the run at its next layer boundary, under ``mid_step``, instead of waiting for
        the next step: their second token comes from this one (single-rank engines). It is
        entered while the model runs, so ``while_running`` must have freed it.
        """
        sched = self.scheduler.schedule()
        outputs = [self._finish_output(r, []) for r in sched.finished]
        now = time.monotonic()
        for request in [*sched.awaiting_kv, *(r for r, _ in sched.scheduled)]:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        awaiting = [
            (r.request_id, list(self.kv.block_table(r.request_id)), r.num_cached_tokens) for r in sched.awaiting_kv
        ]
        if not sched.scheduled:
            with while_running or nullcontext():  # peers' steps may take a while: admissions go on
                ran = self.runner.idle()
            return StepOutput(outputs, awaiting, group_ran_model=ran)
        inputs = self.runner.prepare(sched.scheduled)
        joiners = None
        if mid_step is not None:
            joiners = self._joiners(mid_step, room=self.scheduler.config.max_num_batched_tokens - sched.num_tokens)
        with while_running or nullcontext():
            logits = self.runner.execute(inputs, joiners)
        for request, num_new in inputs.scheduled:
            request.num_computed_tokens += num_new
            self.kv.cache_full_blocks(
                request.request_id, request.token_ids, request.num_computed_tokens, request.cache_salt
            )
        if inputs.sampling_requests:
            rows = [
                SamplingRequest(
                    r.params, r.prompt_token_ids, r.output_token_ids, r.generator, banned_token_ids(r), r.matcher
                )
                for r in inputs.sampling_requests
            ]
            sampled = self.sampler(logits, rows)
            for request, token, logprobs in zip(inputs.sampling_requests, sampled.token_ids, sampled.logprobs):
                outputs.append(self._accept_token(request, token, logprobs))
        num_tokens = sum(n for _, n in inputs.scheduled)
        return StepOutput(outputs, awaiting, num_tokens, group_ran_model=True)

    def _joiners(self, mid_step: AbstractContextManager[object], room: int) -> Callable[[], list[Request]]:
        """The step's late joiners, asked for at each layer boundary: ``room`` tokens at most,
        all at one boundary. Catching up is a second pass over the weights of the layers the
        joiners missed, which the whole batch waits for: once a step bounds that cost."""
        joined = False

        def take() -> list[Request]:
            nonlocal joined
            if joined or not self.scheduler.resumed or room <= 0:  # the common case: no lock taken
                return []
            with mid_step:
                joining = self.scheduler.take_resumed(room)
            joined = bool(joining)
            return joining

        return take

    def _accept_token(self, request: Request, token: int, logprobs: Logprobs | None) -> RequestOutput:
        request.append_output(token, logprobs)
        reason = (
            "kv_transfer" if request.kv_role is KVRole.PRODUCER else stop_reason(request, token, self.max_model_len)
        )
        if reason is None:
            return request_output(request, [token])
        hold = request.kv_role is KVRole.PRODUCER
        # Read before pinning: a "sent" that came early frees the blocks as they are pinned.
        held_block_ids = list(self.kv.block_table(request.request_id)) if hold else None
        self.scheduler.finish(request, reason, pin=hold)
        output = self._finish_output(request, [token])
        output.held_block_ids = held_block_ids
        return output

    def _finish_output(self, request: Request, new: list[int]) -> RequestOutput:
        output = request_output(request, new)
        self._requests.pop(request.request_id, None)
        return output

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel group (they are waiting for steps)."""
        self.runner.stop_followers()

    def check_idle_integrity(self) -> None:
        """Assert the pool is consistent and, with nothing running or pinned, wholly free."""
        self.block_pool.check_integrity()
        if not self.has_unfinished() and not self.num_held:
            assert self.block_pool.all_free(), "blocks leaked: nothing runs but blocks are referenced"
