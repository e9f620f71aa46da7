"""A worker process's parts and their lifecycle.

Start-up order: the engine (already loaded) on its thread, warming up → the metrics port with
its probes → the NIXL agent registering the KV
pool (and, in a group of ranks, every other rank's agent, met over the ``GroupLink``) → the
role's gRPC service → the model's live knobs, read once and then followed → the
etcd registration (last, so that nothing is routed here before it can serve, with the knobs
in force). Shutdown is the reverse, after a drain: the worker reports itself draining
(registry and health), refuses new requests, lets in-flight ones finish — bounded by
``drain_timeout_s`` — then revokes its lease and closes everything it owns. Everything that
talks to etcd shares the runtime's one connection, closed last.

Health has one owner, the runtime: ``readiness`` (``/readyz``: warmed up, registered, its lease
live, not draining) and ``liveness`` (``/livez``: the engine thread comes round its loop within
``liveness_deadline_s``) judge what the runtime and its engine loop already hold.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable

import grpc

from pdserve.discovery.etcd import MAX_CALL_TIMEOUT_S, EtcdConnection
from pdserve.discovery.knobs import Knobs
from pdserve.discovery.knobs_follower import KnobsFollower
from pdserve.discovery.registration import WorkerRegistration
from pdserve.discovery.registry import Role, WorkerEntry
from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_loop import EngineLoop
from pdserve.kvtransfer import KVAgent, KVLayout, PeerInfo, encode_group
from pdserve.lifecycle import install_stack_dump
from pdserve.observability.metrics import WorkerMetrics
from pdserve.observability.probes import MetricsServer, Probes, on_loop
from pdserve.rpc.admin import AdminPolicy
from pdserve.rpc.server import RpcServer
from pdserve.rpc.status import DRAINING, refuse
from pdserve.types.engine_load import EngineLoad
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.worker.config import WorkerConfig
from pdserve.worker.group.leader import WorkerGroup

logger = logging.getLogger(__name__)

# How long /readyz waits for the event loop to read the state it judges.
_READINESS_ANSWER_S = 2.0

WORKER_SERVICE = "pdserve.v1.Worker"


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """The role-independent part of the Worker service; roles override their RPCs.

    An RPC a role does not serve answers UNIMPLEMENTED (the generated base's default).
    """

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    async def start(self) -> None:
        """Acquire what the role needs (called once the agent runs)."""

    async def close(self) -> None:
        """Release what ``start`` acquired (called after the drain)."""

    @property
    def num_waiting(self) -> int:
        """Calls in flight that are not in the engine yet (a drain waits for them too)."""
        return 0

    def knobs_follower(self, apply: Callable[[Knobs | None], Awaitable[None]]) -> KnobsFollower:
        """What follows the model's live knobs for this role: a watch of the model's key."""
        return KnobsFollower.from_etcd(self.runtime.etcd, self.runtime.config.served_model_name, apply)

    async def Drain(
        self, request: worker_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DrainResponse:
        await self.runtime.admin.authorize(context, "Drain")
        self.runtime.request_stop("Drain RPC")
        return worker_pb2.DrainResponse(in_flight=self.runtime.num_in_flight)

    async def refuse_if_draining(self, context: grpc.aio.ServicerContext) -> None:
        """Refuse the call, typed as DRAINING (``pdserve.rpc.status``), while the worker drains."""
        if self.runtime.draining:
            await refuse(context, DRAINING, f"draining: worker {self.runtime.worker_id} takes no new requests")


class WorkerRuntime:
    """Owns a worker's engine loop, NIXL agent, gRPC server, etcd connection and registration."""

    def __init__(
        self, config: WorkerConfig, engine: LLMEngine, group: WorkerGroup | None = None, data_parallel_id: str = ""
    ) -> None:
        """``group``: the worker's other ranks, when it has several (``engine`` is rank 0's).
        ``data_parallel_id``: the id of rank 0 of the data-parallel group this worker is a rank of
        (its registry entry's ``group_id``); "" when it is none."""
        self.config = config
        self.engine = engine
        self.group = group
        self.data_parallel_id = data_parallel_id
        self.worker_id = config.id
        self.engine_loop = EngineLoop(engine)
        parallel = engine.parallel
        self.layout = KVLayout.from_spec(
            engine.kv_cache_spec, model=config.served_model_name, tp_size=parallel.tp_size, tp_rank=parallel.tp_rank
        )
        self.agent = KVAgent(self.worker_id, engine.kv_cache, self.layout, loopback_only=config.loopback_only)
        self.rank_peers: list[PeerInfo] = []  # ranks 1..N-1's agents, published with this one's
        self.failure: str | None = None  # why the worker cannot serve any more, if it cannot
        self.engine_loop.on_error = lambda exc: self.fail(f"its engine stopped: {exc}")
        if group is not None:
            group.link.on_lost = self.fail  # a worker missing a rank cannot serve
        self.metrics = WorkerMetrics(config.role, self.worker_id, config.served_model_name, self._load)
        self.metrics_port: int | None = None
        self._metrics_server: MetricsServer | None = None
        cluster = config.cluster_tls
        self.server = RpcServer(tls=None if cluster is None else cluster.server)
        self.admin = AdminPolicy(config.admin_key, verified_peers=cluster is not None)
        self.etcd = EtcdConnection(config.etcd, min(MAX_CALL_TIMEOUT_S, config.lease_ttl_s / 2), config.etcd_auth)
        self.registration: WorkerRegistration | None = None
        self.knobs: KnobsFollower | None = None
        self.servicer: WorkerServicer | None = None
        self.draining = False
        self.endpoint: str | None = None
        self._stop = asyncio.Event()
        self._stop_reason = ""
        self.on_stop: Callable[[], None] | None = None  # called once as the drain begins

    async def start(self, make_servicer: Callable[[WorkerRuntime], WorkerServicer]) -> None:
        self.engine_loop.start()
        if self.config.metrics_port is not None:
            loop = asyncio.get_running_loop()
            probes = Probes(ready=lambda: on_loop(loop, self.readiness, _READINESS_ANSWER_S), live=self.liveness)
            self._metrics_server = MetricsServer.start(
                self.metrics.registry, self.config.host, self.config.metrics_port, probes
            )
            self.metrics_port = self._metrics_server.port
            print(
                f"pdserve {self.config.role} worker {self.worker_id} probes at "
                f"http://{self.config.host}:{self.metrics_port}/readyz and /livez",
                flush=True,
            )
        await self.agent.start()
        if self.group is not None:
            self.rank_peers = await self.group.wait_agents()
        self.servicer = make_servicer(self)
        await self.servicer.start()
        servicer = self.servicer
        self.server.add(lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s), WORKER_SERVICE)
        port = await self.server.start(self.config.host, self.config.port)
        self.endpoint = f"{self.config.reachable_host}:{port}"
        self.knobs = self.servicer.knobs_follower(self.apply_knobs)
        await self.knobs.start()
        self.registration = WorkerRegistration(
            self.etcd, self._entry(), self._load, draining=self._draining, ttl_s=self.config.lease_ttl_s
        )
        await self.registration.start()
        logger.info("%s serving %s at %s", self.worker_id, self.config.served_model_name, self.endpoint)
        if self.admin.is_open:
            logger.warning(
                "%s: its Drain RPC is open to anyone who reaches %s: give the cluster certificates "
                "or an admin key to protect it",
                self.worker_id,
                self.endpoint,
            )

    def _entry(self) -> WorkerEntry:
        engine = self.engine
        assert self.endpoint is not None
        return WorkerEntry(
            worker_id=self.worker_id,
            role=self.config.role,
            model=self.config.served_model_name,
            model_path=str(engine.model_config.path),
            endpoint=self.endpoint,
            nixl=encode_group([self.agent.info, *self.rank_peers]),
            block_size=engine.kv_cache_spec.block_size,
            num_kv_blocks=engine.block_pool.num_blocks,
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            max_num_seqs=engine.config.max_num_seqs,
            max_num_batched_tokens=engine.config.max_num_batched_tokens,
            started_at=time.time(),
            metrics_port=self.metrics_port,
            load=self._load(),
            draining=self.draining,
            tensor_parallel_size=engine.parallel.tp_size,
            num_kv_heads=0 if engine.kv_cache_spec.is_mla else engine.model_config.num_kv_heads,
            group_id=self.data_parallel_id,
            group_size=engine.parallel.dp_size if self.data_parallel_id else 1,
            group_rank=engine.parallel.dp_rank if self.data_parallel_id else 0,
        )

    def _load(self) -> EngineLoad:
        return self.engine_loop.load

    def readiness(self) -> str | None:
        """Why the worker must not be sent work now, None when it may: it is failing or draining,
        its engine is warming up, or it is not (or no longer) registered. On the event loop."""
        if self.failure is not None:
            return f"failed: {self.failure}"
        if self.draining or self._stop.is_set():
            return "draining"
        if not self.engine_loop.is_warm:
            return "warming up"
        if self.registration is None or not self.registration.is_registered:
            return "not registered"
        return None

    def liveness(self) -> str | None:
        """Why the worker should be restarted, None while its engine makes progress. Any thread."""
        return self.engine_loop.stall(self.config.liveness_deadline_s)

    def _draining(self) -> bool:
        return self.draining

    async def apply_knobs(self, knobs: Knobs | None) -> None:
        """Set the scheduler's limits from the model's live knobs (None: the start-up ones).

        A decode worker takes the decode batch and token budget, a prefill worker the chunk
        size as its token budget; either is capped at its start-up value.
        """
        start = self.engine.config
        seqs, tokens = start.max_num_seqs, start.max_num_batched_tokens
        if knobs is not None and self.config.role is Role.DECODE:
            seqs = min(knobs.decode_max_num_seqs, seqs)
            tokens = min(knobs.decode_max_num_batched_tokens, tokens)
        elif knobs is not None:
            tokens = min(knobs.prefill_chunk_size, tokens)
        seqs = min(seqs, tokens)  # every running request must fit one step's budget
        await self.engine_loop.retune(seqs, tokens)
        logger.info(
            "%s: scheduler limits now %d sequences, %d tokens a step%s",
            self.worker_id,
            seqs,
            tokens,
            "" if knobs is not None else " (start-up settings)",
        )

    def fail(self, reason: str) -> None:
        """The worker cannot serve (a rank or its engine is gone): leave the registry and exit
        with a failure, so that its supervisor starts the whole group again."""
        if self.failure is None:
            self.failure = reason
            logger.error("%s cannot serve: %s", self.worker_id, reason)
        self.draining = True  # new calls are refused as DRAINING from now on, before the drain starts
        self.request_stop(reason)

    def request_stop(self, reason: str) -> None:
        """Begin the drain (idempotent); ``run`` then finishes the work and exits."""
        if not self._stop.is_set():
            self._stop_reason = reason
            self._stop.set()

    async def run(self) -> None:
        """Serve until SIGTERM, SIGINT or a Drain RPC; then drain and close."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig.name)
        install_stack_dump(loop, self.worker_id)
        await self._stop.wait()
        logger.info("%s draining (%s)", self.worker_id, self._stop_reason)
        if self.on_stop is not None:
            self.on_stop()
        await self.drain()
        await self.close()

    async def drain(self) -> None:
        """Stop taking work and wait, up to ``drain_timeout_s``, for in-flight requests."""
        self.draining = True
        await self.server.set_serving(False)
        if self.registration is not None:
            await self.registration.refresh_now()
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.num_in_flight and self.failure is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.num_in_flight:
            logger.warning("%s: drain timed out with %d requests in flight", self.worker_id, self.num_in_flight)

    @property
    def num_in_flight(self) -> int:
        """Requests this worker still owes an answer: in the engine, or waiting to enter it."""
        waiting = self.servicer.num_waiting if self.servicer is not None else 0
        return self.engine_loop.num_in_flight + waiting

    async def close(self) -> None:
        """Leave the registry, stop serving, free the agent and the engine thread."""
        if self.knobs is not None:
            await self.knobs.close()
        if self.registration is not None:
            await self.registration.close()
        await self.server.stop(grace_s=1.0)
        if self.servicer is not None:
            await self.servicer.close()
        await self.agent.close()
        await self.engine_loop.stop()
        if self.group is not None:
            await self.group.close(self.engine)
        await self.etcd.close()  # last: the knobs, the registration and a decode worker's view use it
        if self._metrics_server is not None:
            self._metrics_server.close()
