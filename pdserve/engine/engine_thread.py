"""The engine's own thread: it steps the engine and runs commands between steps, under one lock.

``EngineThread`` steps the engine whenever something is runnable — and, with nothing runnable,
by the earliest pin's deadline, so that pins are freed on time on an idle engine. Commands
(add, abort, KV sent, release) queue up and run between steps, in the order put. Each step's
outputs go to ``deliver``, on this thread. It knows nothing of asyncio: ``EngineLoop`` is the
event loop's side.

With data-parallel attention the engines of a group's ranks step in lockstep (each step's
expert-parallel exchanges need every rank): the thread never sleeps on its queue then, but
steps again and again, a rank without work joining its peers' steps with an empty batch, and
pauses ``lockstep_idle_s`` only after a step in which no rank of the group had anything to run.
Stopping, a rank says so at its next steps and goes on stepping until every rank has said it:
they leave at the same step, and none is left waiting in an exchange.

The decode hand-off does not wait for step boundaries. A consumer is admitted (given blocks)
and resumed after its pull (``kv_received``) on a second thread, the admitter (``submit``),
under the engine's lock — which the engine thread holds for everything but the model run
itself. So a consumer's pull starts while a step runs, and a consumer whose KV lands while the
model runs joins that run at its next layer boundary (``LLMEngine.step``'s ``mid_step``), else
the next step; the engine thread never waits on a pull.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

from pdserve.engine.engine import LLMEngine
from pdserve.engine.heartbeat import Heartbeat
from pdserve.engine.output import RequestOutput
from pdserve.types.engine_load import EngineLoad

logger = logging.getLogger(__name__)

# A step's finished and produced outputs, and its consumers newly awaiting KV
# (request id, block ids, cached tokens).
Deliver = Callable[[list[RequestOutput], list[tuple[str, list[int], int]]], None]


class EngineThread:
    """Steps ``engine`` on a dedicated thread from ``start()`` until ``end()``.

    ``deliver`` takes each step's outputs on the engine thread. ``on_failure`` takes the
    exception that ends the thread, once ``error`` is set; the thread then takes no command.
    """

    def __init__(
        self,
        engine: LLMEngine,
        deliver: Deliver,
        on_failure: Callable[[BaseException], None],
        *,
        idle_wait_s: float,
        lockstep_idle_s: float,
    ) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.lockstep = engine.parallel.dp_size > 1
        self.lockstep_idle_s = lockstep_idle_s
        self._deliver = deliver
        self._on_failure = on_failure
        self._commands: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # The engine's load after its last step or admission.
        self.load = EngineLoad(kv_blocks_total=engine.block_pool.num_blocks)
        # The exception that stopped the thread, if one did.
        self.error: BaseException | None = None
        # Beats from the end of the warm-up on: before and after each step, and at each idle wake.
        self.heartbeat = Heartbeat()
        # Held by the engine thread except while the model runs; the admitter takes it.
        self._lock = threading.Lock()
        self._admitter: ThreadPoolExecutor | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        # One thread: consumer admissions, resumes and their aborts run in the order sent.
        self._admitter = ThreadPoolExecutor(1, thread_name_prefix="pdserve-admit")
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_started(self) -> bool:
        """Started and not yet joined."""
        return self._thread is not None

    @property
    def is_alive(self) -> bool:
        """The thread runs (started, and neither ended nor failed)."""
        return self._thread is not None and self._thread.is_alive()

    def end(self) -> None:
        """End the thread after the commands already put (lockstep: at the step the whole group leaves)."""
        if self.lockstep:
            self._commands.put(self._leave)
        else:
            self._commands.put(None)

    def join(self, timeout_s: float) -> None:
        """Wait for the thread to end (at most ``timeout_s``) and drop the admitter's queue."""
        assert self._thread is not None, "start() first"
        self._thread.join(timeout_s)
        self._thread = None
        if self._admitter is not None:
            self._admitter.shutdown(wait=False, cancel_futures=True)
            self._admitter = None

    # ---- commands ----------------------------------------------------------------------------
    def put(self, command: Callable[[], object]) -> None:
        """Run ``command`` on the engine thread, under the lock, before its next step."""
        self._commands.put(command)

    def wake(self) -> None:
        """Step again, even if the thread sleeps with nothing runnable."""
        self._commands.put(_step_again)

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` as a command; its result (or exception) completes the future.

        ``fn`` runs even if the future is cancelled meanwhile (its caller cleans up after it);
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
        return done

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on the admitter thread under the engine's lock."""
        assert self._admitter is not None, "start() first"

        def locked() -> Any:
            with self._lock:
                result = fn()
                self.load = self._snapshot()  # an admission counts before the next step ends
                return result

        return self._admitter.submit(locked)

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with self._lock:  # on this thread: its OpenMP team is the one that steps
                self.engine.warm_up()
                self.load = self._snapshot()
            while True:
                self.heartbeat.beat()
                # Block for a command only when a step would have nothing to run.
                with self._lock:
                    idle = not self.engine.has_unfinished() and not self.lockstep
                while True:
                    try:
                        command = self._commands.get(timeout=self.idle_wait_s) if idle else self._commands.get_nowait()
                    except queue.Empty:
                        break
                    finally:
                        self.heartbeat.beat()
                    if command is None:
                        return
                    with self._lock:
                        command()
                    idle = False
                with self._lock:
                    step = self.engine.step(while_running=_Released(self._lock), mid_step=self._lock)
                    # Snapshot first: whoever reads an output must see the load it left behind.
                    self.load = self._snapshot()
                self.heartbeat.beat()
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
            self.error = exc
            self._on_failure(exc)

    def _leave(self) -> None:
        self.engine.runner.staying = False

    def _wait_for_command(self) -> Callable[[], object] | None:
        """Nothing is runnable (requests wait for KV, or none): sleep until the next command,
        or until the earliest pin's deadline, when stepping again frees it."""
        while True:
            timeout = self.engine.seconds_to_next_deadline()
            try:
                return self._commands.get(timeout=1.0 if timeout is None else min(timeout, 1.0))
            except queue.Empty:
                if timeout is not None and timeout <= 1.0:
                    return _step_again
                continue
            finally:
                self.heartbeat.beat()

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
