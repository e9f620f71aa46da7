"""The engine's step loop on its own thread, driven from asyncio.

Servers run on an asyncio event loop; the engine's step blocks for as long as the model runs.
``EngineLoop`` owns one thread that steps the engine: the event loop sends it commands (add,
abort, KV sent, release) through a queue, and the thread steps the engine whenever something
is runnable — and, with nothing runnable, by the earliest pin's deadline, so that pins are
freed on time on an idle engine — and hands each request's outputs back to the event loop,
where ``RequestStream`` delivers them to whoever awaits that request.

With data-parallel attention the engines of a group's ranks step in lockstep (each step's
expert-parallel exchanges need every rank): the thread never sleeps on its queue then, but
steps again and again, a rank without work joining its peers' steps with an empty batch, and
pauses ``lockstep_idle_s`` only after a step in which no rank of the group had anything to run.
Stopping, a rank says so at its next steps and goes on stepping until every rank has said it:
they leave at the same step, and none is left waiting in an exchange.

The decode hand-off does not wait for step boundaries. A consumer is admitted (given blocks)
and resumed after its pull (``kv_received``) on a second thread, the admitter, under the
engine's lock — which the engine thread holds for everything but the model run itself. So a
consumer's pull starts while a step runs, and a consumer whose KV lands while the model runs
joins that run at its next layer boundary (``LLMEngine.step``'s ``mid_step``), else the next
step; the engine thread never waits on a pull.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.request import KVRole
from pdserve.types.engine_load import EngineLoad
from pdserve.types.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
    """The engine thread has died (a rank of its group is gone, say): it takes no request."""


@dataclass(frozen=True)
class KVAwaited:
    """Decode role: the request has blocks; its prompt's KV must now be written into them."""

    block_ids: list[int]
    num_cached_tokens: int  # leading prompt tokens already in this engine's prefix cache


class RequestStream:
    """One request's outputs, in order, on the event loop; ends after the finished output."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._items: asyncio.Queue[RequestOutput | KVAwaited] = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | KVAwaited) -> None:
        self._items.put_nowait(item)

    async def next(self) -> RequestOutput | KVAwaited:
        """The next item; a RequestOutput with ``finished`` set is the last."""
        item = await self._items.get()
        if isinstance(item, RequestOutput) and item.finished:
            self.finished = True
        return item

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Every RequestOutput until the finished one (KV notices are not expected here)."""
        while not self.finished:
            item = await self.next()
            if isinstance(item, RequestOutput):
                yield item


class EngineLoop:
    """Runs ``engine`` on a dedicated thread; every method is called from the event loop.

    ``start()`` from a running event loop, ``await stop()`` to end the thread. Requests whose
    stream nobody reads any more must be aborted (``abort``), which frees their blocks.
    """

    def __init__(self, engine: LLMEngine, *, idle_wait_s: float = 0.05, lockstep_idle_s: float = 0.002) -> None:
        self.engine = engine
        # Called on the engine thread with each PRODUCER's output the moment its prompt is done,
        # before the event loop has it; it must not block (a prefill worker's KVAnnouncer).
        self.on_produced: Callable[[RequestOutput], None] | None = None
        self.idle_wait_s = idle_wait_s
        self.lockstep = engine.parallel.dp_size > 1
        self.lockstep_idle_s = lockstep_idle_s
        self._commands: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._load = EngineLoad(kv_blocks_total=engine.block_pool.num_blocks)
        self._error: BaseException | None = None
        # Held by the engine thread except while the model runs; the admitter takes it.
        self._lock = threading.Lock()
        self._admitter: ThreadPoolExecutor | None = None
        # Called on the event loop when the engine thread dies (its owner stops serving).
        self.on_error: Callable[[BaseException], None] | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # One thread: consumer admissions, resumes and their aborts run in the order sent.
        self._admitter = ThreadPoolExecutor(1, thread_name_prefix="pdserve-admit")
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Abort what is left, free every pin, end the thread (bounded by ``timeout_s``)."""
        if self._thread is None:
            return
        for request_id in list(self._streams):
            self.abort(request_id)
        self._commands.put(self.engine.release_pins)
        if self.lockstep:
            self._commands.put(self._leave)
        else:
            self._commands.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout_s)
        self._thread = None
        if self._admitter is not None:
            self._admitter.shutdown(wait=False, cancel_futures=True)
            self._admitter = None

    @property
    def load(self) -> EngineLoad:
        """The engine's load after its last step."""
        return self._load

    @property
    def num_in_flight(self) -> int:
        """Requests with a live stream, plus producer requests whose blocks are still held."""
        return len(self._streams) + self._load.held_requests

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the engine thread, if one did."""
        return self._error

    # ---- commands ----------------------------------------------------------------------------
    async def add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        kv_role: KVRole = KVRole.LOCAL,
        *,
        pin_s: float | None = None,
        generated_token_ids: list[int] | None = None,
    ) -> RequestStream:
        """Queue a request; raises ValueError (from the engine) for one it cannot serve.

        Raises EngineStopped once the engine thread has died. A PRODUCER's blocks stay pinned at most ``pin_s`` after it finishes; ``generated_token_ids``
        resume a request begun elsewhere (both: ``LLMEngine.add_request``). A CONSUMER is given
        blocks at once when a seat and blocks are free, even while a step runs
        (``LLMEngine.admit_consumer``): its stream then starts with the ``KVAwaited``.
        """
        if self._error is not None:
            raise EngineStopped(f"the engine stopped: {self._error}")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        engine = self.engine
        try:
            if kv_role is KVRole.CONSUMER:
                admitted = await self._admit(lambda: engine.admit_consumer(request_id, prompt, params, generated_token_ids))
                if admitted is not None:
                    stream._put(KVAwaited(*admitted))
            else:
                arrived = time.monotonic()  # the wait for the step under way is part of its queue time
                await self._call(lambda: engine.add_request(
                    request_id, prompt, params, kv_role, pin_s=pin_s, generated_token_ids=generated_token_ids,
                    arrival_time=arrived,
                ))  # fmt: skip
        except BaseException:
            # Cancelled while queued, the add still runs: the abort queued behind it, on the
            # same thread, ends the request there (a no-op if the add failed).
            if kv_role is KVRole.CONSUMER:
                self._streams.pop(request_id, None)
                self._submit(lambda: engine.abort(request_id))
            else:
                self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """End the request wherever it is and free its blocks (pinned ones included)."""
        self._streams.pop(request_id, None)
        self._commands.put(lambda: self.engine.abort(request_id))

    async def kv_received(self, request_id: str, first_token_id: int) -> None:
        """Decode role: the KV is in the request's blocks; its outputs continue on its stream.

        Runs at once, even while a step runs; the request joins the step under way at a layer
        boundary, or the next one.
        """

        def received() -> None:
            final = self.engine.kv_received(request_id, first_token_id)
            if final is not None:
                self._deliver([final], [])

        await self._admit(received)
        self._commands.put(_step_again)  # an engine thread asleep with nothing runnable wakes

    def kv_sent(self, request_id: str) -> None:
        """Prefill role: the decode side is done with the request's pinned blocks (``LLMEngine.kv_sent``)."""
        self._commands.put(lambda: self.engine.kv_sent(request_id))

    async def release_pin(self, request_id: str) -> bool:
        """Prefill role: free the request's pin if it is still there; False when it was not."""
        return await self._call(lambda: self.engine.release_pin(request_id))

    async def retune(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Change the scheduler's limits (``LLMEngine.retune``); raises its ValueError."""
        await self._call(lambda: self.engine.retune(max_num_seqs, max_num_batched_tokens))

    def _submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on the admitter thread under the engine's lock."""
        assert self._admitter is not None, "start() first"

        def locked() -> Any:
            with self._lock:
                result = fn()
                self._load = self._snapshot()  # an admission counts before the next step ends
                return result

        return self._admitter.submit(locked)

    async def _admit(self, fn: Callable[[], Any]) -> Any:
        """``fn``'s result from the admitter thread; it runs even if the caller is cancelled."""
        return await asyncio.shield(asyncio.wrap_future(self._submit(fn)))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread and return (or raise) its result.

        ``fn`` runs even if the caller is cancelled meanwhile (the caller cleans up after it);
        its outcome then has nobody to go to, and must not stop the engine thread.
        """
        done: Future[Any] = Future()

        def command() -> None:
            try:
                result = fn()
            except BaseException as exc:  # handed to the caller, not the engine thread
                if not _settle(done.set_exception, exc):
                    logger.warning("a command whose caller was cancelled failed: %r", exc)
            else:
                _settle(done.set_result, result)

        self._commands.put(command)
        return await asyncio.wrap_future(done)

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with self._lock:  # on this thread: its OpenMP team is the one that steps
                self.engine.warm_up()
                self._load = self._snapshot()
            while True:
                # Block for a command only when a step would have nothing to run.
                with self._lock:
                    idle = not self.engine.has_unfinished() and not self.lockstep
                while True:
                    try:
                        command = self._commands.get(timeout=self.idle_wait_s) if idle else self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if command is None:
                        return
                    with self._lock:
                        command()
                    idle = False
                with self._lock:
                    step = self.engine.step(while_running=_Released(self._lock), mid_step=self._lock)
                    # Snapshot first: whoever reads an output must see the load it left behind.
                    self._load = self._snapshot()
                self._deliver(step.outputs, step.awaiting_kv)
                if self.lockstep:
                    if not self.engine.runner.group_staying:
                        return
                    if not step.group_ran_model:
                        time.sleep(self.lockstep_idle_s)
                elif step.num_scheduled_tokens == 0 and not step.outputs:
                    command = self._wait_for_command()
                    if command is None:
                        return
                    with self._lock:
                        command()
        except BaseException as exc:
            logger.exception("engine thread stopped")
            self._error = exc
            self._fail_all(exc)
            if self.on_error is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(self.on_error, exc)

    def _leave(self) -> None:
        self.engine.runner.staying = False

    def _wait_for_command(self) -> Callable[[], object] | None:
        """Nothing is runnable (requests wait for KV, or none): sleep until the next command,
        or until the earliest pin's deadline, when stepping again frees it."""
        while True:
            timeout = self.engine.seconds_to_next_deadline()
            try:
                return self._commands.get(timeout=1.0 if timeout is None else timeout)
            except queue.Empty:
                if timeout is not None:
                    return _step_again
                continue

    def _deliver(self, outputs: list[RequestOutput], awaiting: list[tuple[str, list[int], int]]) -> None:
        if self.on_produced is not None:
            for output in outputs:
                if output.finish_reason == "kv_transfer":
                    try:
                        self.on_produced(output)
                    except Exception:  # a hook's failure is the hook's, not the engine's
                        logger.exception("on_produced failed for %s", output.request_id)
        items: list[tuple[str, RequestOutput | KVAwaited]] = [(o.request_id, o) for o in outputs]
        items += [(rid, KVAwaited(blocks, cached)) for rid, blocks, cached in awaiting]
        if items and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, items)

    def _dispatch(self, items: list[tuple[str, RequestOutput | KVAwaited]]) -> None:
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # aborted meanwhile: the abort command frees it
            stream._put(item)
            if isinstance(item, RequestOutput) and item.finished:
                del self._streams[request_id]

    def _fail_all(self, exc: BaseException) -> None:
        """The engine is broken: end every stream with an abort so that no caller hangs."""
        if self._loop is None:
            return
        finals = [
            RequestOutput(rid, [], [], finished=True, finish_reason="abort") for rid in list(self._streams)
        ]
        items: list[tuple[str, RequestOutput | KVAwaited]] = [(o.request_id, o) for o in finals]
        self._loop.call_soon_threadsafe(self._dispatch, items)

    def _snapshot(self) -> EngineLoad:
        engine = self.engine
        scheduler = engine.scheduler
        queued = sum(r.num_prompt_tokens - r.num_computed_tokens for r in scheduler.waiting)
        queued += sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in scheduler.running)
        pool = engine.block_pool
        return EngineLoad(
            running=len(scheduler.running) + len(scheduler.awaiting_kv),
            awaiting_kv=len(scheduler.awaiting_kv),
            waiting=len(scheduler.waiting),
            held_requests=engine.num_held,
            kv_blocks_used=pool.num_blocks - pool.num_free_blocks,
            kv_blocks_total=pool.num_blocks,
            queued_prefill_tokens=queued,
            num_preemptions=scheduler.num_preemptions,
            max_num_seqs=scheduler.config.max_num_seqs,
            max_num_batched_tokens=scheduler.config.max_num_batched_tokens,
        )


async def build_engine(build: Callable[[], LLMEngine]) -> LLMEngine:
    """Run ``build`` (an engine's construction) on a thread of its own that then ends.

    OpenMP (torch's and the CPU kernels') keeps a team of threads for each thread that starts
    parallel work, and libgomp stops the workers of every team from spinning between parallel
    regions once it manages more threads than there are CPUs. An engine built on the main
    thread and stepped on ``EngineLoop``'s thread would leave two teams behind, and every
    parallel region of every step would wait for sleeping workers to wake: on 2 CPUs a decode
    step of SmolLM2-135M took 21-23 ms instead of 14.6 (bench/RESULTS.md). A thread that ends
    takes its team with it, so the engine thread's is the only one.
    """
    builder = ThreadPoolExecutor(1, thread_name_prefix="pdserve-load")
    try:
        return await asyncio.get_running_loop().run_in_executor(builder, build)
    finally:
        builder.shutdown(wait=True)


class _Released:
    """Releases a held lock for the duration of a ``with`` block (the model run)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        self._lock.release()

    def __exit__(self, *exc: object) -> None:
        self._lock.acquire()


def _step_again() -> None:
    """The command that only wakes the engine thread: a pin's deadline has passed."""


def _settle(setter: Callable[[Any], None], value: Any) -> bool:
    """Complete a command's future; False when its caller was cancelled (asyncio cancels the
    wrapped future, from the event loop's thread, at any moment)."""
    try:
        setter(value)
    except InvalidStateError:
        return False
    return True
