"""The public ``pdserve.v1.Inference`` service on the frontend.

``Generate`` admits a request (queue limit), validates it (``ModelCatalog``), and streams its
``RequestFlow``; failures become gRPC statuses whose message names the cause. The frontend
keeps no state about a request beyond its flow: cancelling the call cancels the flow, which
cancels the worker calls, which abort the request on the workers.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import msgspec

from pdserve.discovery.registry import WorkerEntry
from pdserve.discovery.registry_view import RegistryView
from pdserve.frontend.catalog import InvalidRequest, ModelCatalog, ModelUnavailable
from pdserve.frontend.channels import WorkerChannels
from pdserve.frontend.config import FrontendConfig
from pdserve.frontend.flow import FlowError, RequestFlow, Routing
from pdserve.frontend.router import Router
from pdserve.observability.frontend_stats import FrontendStats, RollingWindow
from pdserve.observability.metrics import FrontendMetrics
from pdserve.v1 import inference_pb2, inference_pb2_grpc

logger = logging.getLogger(__name__)

INFERENCE_SERVICE = "pdserve.v1.Inference"


class InferenceService(inference_pb2_grpc.InferenceServicer):
    def __init__(self, config: FrontendConfig, view: RegistryView) -> None:
        self.config = config
        self.catalog = ModelCatalog(config.tokenizer)
        self.routing = Routing(view, Router(config.router), WorkerChannels(), config.max_migrations)
        self.num_in_flight = 0
        self.metrics = FrontendMetrics(lambda: self.num_in_flight)
        self.window = RollingWindow(config.stats_window_s)
        view.add_listener(self._on_registry_change)

    def _on_registry_change(self, added: list[WorkerEntry], removed: list[WorkerEntry]) -> None:
        for entry in added:
            logger.info("worker joined: %s %s at %s", entry.role, entry.worker_id, entry.endpoint)
        for entry in removed:
            logger.info("worker left: %s %s", entry.role, entry.worker_id)
            self.routing.router.forget(entry.worker_id)
            self.routing.channels.close(entry.endpoint)

    async def close(self) -> None:
        await self.routing.channels.close_all()

    def stats(self, frontend_id: str) -> FrontendStats:
        """What this frontend publishes for the planner and ``pdserve status``."""
        router = self.config.router
        threshold = router.local_prefill_threshold_tokens if router.disaggregation == "conditional" else None
        return msgspec.structs.replace(self.window.snapshot(frontend_id), local_prefill_tokens=threshold)

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        models = self.catalog.models(self.routing.view.workers())
        return inference_pb2.ListModelsResponse(
            models=[
                inference_pb2.ModelInfo(
                    name=m.name,
                    max_model_len=m.max_model_len,
                    vocab_size=m.vocab_size,
                    prefill_workers=m.num_prefill,
                    decode_workers=m.num_decode,
                )  # fmt: skip
                for m in models.values()
            ]
        )

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        arrival = time.monotonic()
        if self.num_in_flight >= self.config.max_queued_requests:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.num_in_flight} requests in flight: the queue limit (max_queued_requests) is "
                f"{self.config.max_queued_requests}; retry later",
            )
        try:
            valid = self.catalog.validate(request, self.routing.view.workers())
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ModelUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        self.window.arrived(valid.model.name)
        remaining = context.time_remaining()
        timeout = (
            min(remaining, self.config.request_timeout_s) if remaining is not None else self.config.request_timeout_s
        )
        request_id = request.request_id or uuid.uuid4().hex
        flow = RequestFlow(self.routing, valid, request_id, arrival, arrival + timeout)
        self.num_in_flight += 1
        code = grpc.StatusCode.CANCELLED  # unless it ends otherwise: the client went away
        try:
            async for response in flow.run():
                yield response
            code = grpc.StatusCode.OK
        except FlowError as exc:
            code = exc.code
            logger.info("request %s failed: %s %s", request_id, exc.code.name, exc.message)
            await context.abort(exc.code, exc.message)
        finally:
            self.num_in_flight -= 1
            self._record(valid.model.name, flow, code)

    def _record(self, model: str, flow: RequestFlow, code: grpc.StatusCode) -> None:
        m = self.metrics
        m.requests.labels(model, code.name).inc()
        if flow.num_migrations:
            m.migrations.labels(model).inc(flow.num_migrations)
        if code == grpc.StatusCode.CANCELLED:  # the caller left: neither a latency nor a failure of ours
            return
        b, gaps = flow.breakdown, flow.token_gaps()
        ok = code == grpc.StatusCode.OK
        e2e_s = b.e2e_ms / 1e3 if ok else time.monotonic() - flow.arrival
        self.window.record(
            model, time.time() - e2e_s, ttft_s=b.ttft_ms / 1e3, itl_s=gaps or None, e2e_s=e2e_s,
            prompt_tokens=len(flow.request.token_ids), output_tokens=flow.num_tokens, ok=ok,
        )  # fmt: skip
        if not ok:
            return
        m.ttft_seconds.labels(model).observe(b.ttft_ms / 1e3)
        m.e2e_seconds.labels(model).observe(b.e2e_ms / 1e3)
        itl = m.itl_seconds.labels(model)
        for gap in gaps:
            itl.observe(gap)
        if b.disaggregated and b.ttft_ms > 0:
            m.kv_transfer_share.labels(model).observe(min(b.kv_transfer_ms / b.ttft_ms, 1.0))
