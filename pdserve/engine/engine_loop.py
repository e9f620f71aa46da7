"""The engine's step loop on its own thread, driven from asyncio.

Servers run on an asyncio event loop; the engine's step blocks for as long as the model runs.
``EngineLoop`` is the event loop's side of ``EngineThread``, which steps the engine on a thread
of its own: each of its methods turns into a command for that thread (or, for a consumer's
admission and resume, for the admitter beside it), and each request's outputs come back to the
event loop, where ``RequestStream`` delivers them to whoever awaits that request. When and how
the thread steps — idle waits, pin deadlines, lockstep, late joins — is ``engine_thread``'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.output import RequestOutput
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
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = EngineThread(
            engine, self._deliver, self._failed, idle_wait_s=idle_wait_s, lockstep_idle_s=lockstep_idle_s
        )
        # Called on the event loop when the engine thread dies (its owner stops serving).
        self.on_error: Callable[[BaseException], None] | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Abort what is left, free every pin, end the thread (bounded by ``timeout_s``)."""
        if not self._thread.is_started:
            return
        for request_id in list(self._streams):
            self.abort(request_id)
        self._thread.put(self.engine.release_pins)
        self._thread.end()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout_s)

    @property
    def load(self) -> EngineLoad:
        """The engine's load after its last step."""
        return self._thread.load

    @property
    def num_in_flight(self) -> int:
        """Requests with a live stream, plus producer requests whose blocks are still held."""
        return len(self._streams) + self._thread.load.held_requests

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the engine thread, if one did."""
        return self._thread.error

    @property
    def is_warm(self) -> bool:
        """The engine thread has run its warm-up (the first forward passes) and steps."""
        return self._thread.heartbeat.has_beaten

    def stall(self, deadline_s: float) -> str | None:
        """Why the engine thread is not live, None while it is: it failed or ended, has not
        finished its warm-up, or has not come round its loop for ``deadline_s`` (a hung step or
        command; an idle thread comes round at least every second). Safe from any thread."""
        if self._thread.error is not None:
            return f"engine thread failed: {self._thread.error!r}"
        if not self._thread.is_alive:
            return "engine thread not running"
        if not self._thread.heartbeat.has_beaten:
            return "engine warming up"
        stall = self._thread.heartbeat.stall(deadline_s)
        return None if stall is None else f"engine thread: {stall}"

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
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request; raises ValueError (from the engine) for one it cannot serve.

        Raises EngineStopped once the engine thread has died. A PRODUCER's blocks stay pinned at most ``pin_s`` after it finishes; ``generated_token_ids``
        resume a request begun elsewhere, ``cache_salt`` keeps its prefix-cache blocks to its
        salt (all: ``LLMEngine.add_request``). A CONSUMER is given
        blocks at once when a seat and blocks are free, even while a step runs
        (``LLMEngine.admit_consumer``): its stream then starts with the ``KVAwaited``.
        """
        if self._thread.error is not None:
            raise EngineStopped(f"the engine stopped: {self._thread.error}")
        # Refused before anything is keyed by the id: the stream and the engine's request under
        # it belong to the request that holds it, and must not be replaced or aborted by a repeat.
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.structured is not None:
            # Compiled here, on a thread of its own, so that the step never waits for a new
            # schema; the engine's add then finds it in its cache.
            await asyncio.to_thread(self.engine.compile_grammar, params.structured)
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        engine = self.engine
        made: list[bool] = []  # set on the engine's side once this call's request exists there
        arrived = time.monotonic()  # the wait for the step under way is part of its queue time

        def admit() -> tuple[list[int], int] | None:
            admitted = engine.admit_consumer(request_id, prompt, params, generated_token_ids, cache_salt)
            made.append(True)
            return admitted

        def queue() -> None:
            engine.add_request(
                request_id,
                prompt,
                params,
                kv_role,
                pin_s=pin_s,
                generated_token_ids=generated_token_ids,
                arrival_time=arrived,
                cache_salt=cache_salt,
            )
            made.append(True)

        def abort_if_made() -> None:
            if made:  # the engine refused the add otherwise: the id may be another request's (a pin)
                engine.abort(request_id)

        try:
            if kv_role is KVRole.CONSUMER:
                admitted = await self._admit(admit)
                if admitted is not None:
                    stream._put(KVAwaited(*admitted))
            else:
                await self._call(queue)
        except BaseException:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            # Cancelled while queued, the add still runs: this abort, queued behind it on the
            # same thread, ends the request there if the add made it.
            if kv_role is KVRole.CONSUMER:
                self._thread.submit(abort_if_made)
            else:
                self._thread.put(abort_if_made)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """End the request wherever it is and free its blocks (pinned ones included)."""
        self._streams.pop(request_id, None)
        self._thread.put(lambda: self.engine.abort(request_id))

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
        self._thread.wake()  # an engine thread asleep with nothing runnable wakes

    def kv_sent(self, request_id: str) -> None:
        """Prefill role: the decode side is done with the request's pinned blocks (``LLMEngine.kv_sent``)."""
        self._thread.put(lambda: self.engine.kv_sent(request_id))

    async def release_pin(self, request_id: str) -> bool:
        """Prefill role: free the request's pin if it is still there; False when it was not."""
        return await self._call(lambda: self.engine.release_pin(request_id))

    async def retune(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Change the scheduler's limits (``LLMEngine.retune``); raises its ValueError."""
        await self._call(lambda: self.engine.retune(max_num_seqs, max_num_batched_tokens))

    async def _admit(self, fn: Callable[[], Any]) -> Any:
        """``fn``'s result from the admitter thread; it runs even if the caller is cancelled."""
        return await asyncio.shield(asyncio.wrap_future(self._thread.submit(fn)))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread and return (or raise) its result.

        ``fn`` runs even if the caller is cancelled meanwhile (the caller cleans up after it);
        its outcome then has nobody to go to, and must not stop the engine thread.
        """
        return await asyncio.wrap_future(self._thread.call(fn))

    # ---- back from the engine thread ----------------------------------------------------------
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

    def _failed(self, exc: BaseException) -> None:
        """The engine is broken: end every stream with an abort so that no caller hangs, then
        tell the owner."""
        if self._loop is None:
            return
        finals = [RequestOutput(rid, [], [], finished=True, finish_reason="abort") for rid in list(self._streams)]
        items: list[tuple[str, RequestOutput | KVAwaited]] = [(o.request_id, o) for o in finals]
        self._loop.call_soon_threadsafe(self._dispatch, items)
        if self.on_error is not None:
            self._loop.call_soon_threadsafe(self.on_error, exc)


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
