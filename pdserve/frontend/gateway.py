"""The one request path behind both public APIs: admit, validate, run the flow, record.

``Gateway.admit`` checks the queue limit, validates the request (``ModelCatalog``: the prompt
is tokenized there, off the event loop) and makes its ``RequestFlow``; ``Admitted.responses``
streams it and records its metrics when it ends. The gRPC service (``service.py``) and the
OpenAI HTTP API (``openai_api``) are adapters that turn their wire formats into a
``GenerateRequest`` and the messages back: routing, disaggregation, stop strings, deadlines and
metrics are the same for both.

A request counts against ``max_queued_requests`` from its admission until its stream ends, or
until ``release`` when it is never streamed (an HTTP request of several choices whose later
choice was refused).

A gRPC caller may name its request (``request_id``, for its logs). That name is scoped to the
caller (its API key; every caller alike without keys): a second request under a name the same
caller has in flight is refused, and the workers never see the name alone. They get
``NAME-RANDOM``, so one caller's names can neither collide with nor stall another's requests,
and a name held by another caller says nothing. The HTTP API makes its own unique ids.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator

import grpc
import msgspec

from pdserve.discovery.registry import WorkerEntry
from pdserve.discovery.registry_view import RegistryView
from pdserve.frontend.attempt import FlowError
from pdserve.frontend.cache_salt import combine
from pdserve.frontend.catalog import InvalidRequest, ModelCatalog, ModelInfo, ModelUnavailable, UnknownModel
from pdserve.frontend.channels import WorkerChannels
from pdserve.frontend.char_budget import TOKENIZE_WAIT_S, Busy, CharBudget
from pdserve.frontend.config import FrontendConfig
from pdserve.frontend.flow import RequestFlow
from pdserve.frontend.router import Router
from pdserve.frontend.routing import Routing
from pdserve.observability.frontend_stats import FrontendStats, RollingWindow
from pdserve.observability.metrics import FrontendMetrics
from pdserve.v1 import inference_pb2

logger = logging.getLogger(__name__)

# The longest caller-chosen request_id: it travels in every worker call and log line of the request.
MAX_REQUEST_ID_CHARS = 256


class Rejected(Exception):
    """The request was refused before it started; ``code`` and ``message`` go to the client."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Gateway:
    """What the frontend shares with every request, and the path each takes."""

    def __init__(self, config: FrontendConfig, view: RegistryView) -> None:
        self.config = config
        budget = CharBudget(config.max_tokenizing_chars, TOKENIZE_WAIT_S)
        self.catalog = ModelCatalog(config.tokenizer, config.max_prompt_chars, budget)
        channels = WorkerChannels(None if config.cluster_tls is None else config.cluster_tls.client)
        self.routing = Routing(view, Router(config.router), channels, config.max_migrations, config.migration_wait_s)
        self.num_in_flight = 0
        self._named: set[tuple[str, str]] = set()  # (caller, request_id) of callers' named requests in flight
        self.metrics = FrontendMetrics(lambda: self.num_in_flight)
        self.window = RollingWindow(config.stats_window_s)
        view.add_listener(self._on_registry_change)
        self._on_registry_change(view.workers(), [])  # those registered before this frontend started

    def _on_registry_change(self, added: list[WorkerEntry], removed: list[WorkerEntry]) -> None:
        for entry in added:
            logger.info("worker joined: %s %s at %s", entry.role, entry.worker_id, entry.endpoint)
            self.routing.channels.connect(entry.endpoint)
            self.routing.channels.in_background(self.catalog.preload(entry.model, entry.model_path))
        for entry in removed:
            logger.info("worker left: %s %s", entry.role, entry.worker_id)
            self.routing.router.forget(entry.worker_id)
            self.routing.channels.close(entry.endpoint)

    async def close(self) -> None:
        await self.routing.channels.close_all()

    def models(self) -> dict[str, ModelInfo]:
        """The models served now (those with a registered worker)."""
        return self.catalog.models(self.routing.view.workers())

    def stats(self, frontend_id: str, metrics_endpoint: str | None = None) -> FrontendStats:
        """What this frontend publishes for the planner, ``pdserve status`` and ``pdserve top``."""
        router = self.config.router
        threshold = router.local_prefill_threshold_tokens if router.disaggregation == "conditional" else None
        return msgspec.structs.replace(
            self.window.snapshot(frontend_id), local_prefill_tokens=threshold, metrics_endpoint=metrics_endpoint
        )

    async def admit(
        self,
        request: inference_pb2.GenerateRequest,
        timeout_s: float | None,
        *,
        caller: str | None = None,
        add_special_tokens: bool = True,
        fill_context: bool = False,
        key_salt: str | None = None,
    ) -> Admitted:
        """The request, validated and counted in flight; raises Rejected (RESOURCE_EXHAUSTED past
        the queue limit, NOT_FOUND for an unknown model, INVALID_ARGUMENT naming the field or a
        ``request_id`` the caller has in flight, UNAVAILABLE without workers). ``timeout_s``: the
        caller's deadline, if it set one; ``caller``: who chose ``request_id`` (its API key's
        name, ``ApiKeys.identify``), None when the frontend made it; ``key_salt``: the caller's
        key's prefix-cache salt (``ApiKeys.cache_salt``), combined with the request's own; the
        other keywords: ``ModelCatalog.validate``'s."""
        arrival = time.monotonic()
        name = self._name(request.request_id, caller)
        if self.num_in_flight >= self.config.max_queued_requests:
            raise Rejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.num_in_flight} requests in flight: the queue limit (max_queued_requests) is "
                f"{self.config.max_queued_requests}; retry later",
            )
        self.num_in_flight += 1  # now: a prompt being tokenized holds its place too
        if name is not None:
            self._named.add(name)
        try:
            valid = await self.catalog.validate(
                request,
                self.routing.view.workers(),
                add_special_tokens=add_special_tokens,
                fill_context=fill_context,
                cache_salt=combine(key_salt, request.cache_salt),
            )
        except BaseException as exc:  # refused, or cancelled while tokenizing (the caller left)
            self._left(name)
            if isinstance(exc, UnknownModel):
                raise Rejected(grpc.StatusCode.NOT_FOUND, str(exc)) from None
            if isinstance(exc, InvalidRequest):
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            if isinstance(exc, ModelUnavailable):
                raise Rejected(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
            if isinstance(exc, Busy):
                raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
            raise
        self.window.arrived(valid.model.name)
        limit = self.config.request_timeout_s
        timeout = min(timeout_s, limit) if timeout_s is not None else limit
        if not request.request_id:
            request_id = uuid.uuid4().hex
        elif caller is None:
            request_id = request.request_id
        else:
            request_id = f"{request.request_id}-{uuid.uuid4().hex[:12]}"
        flow = RequestFlow(self.routing, valid, request_id, arrival, arrival + timeout)
        return Admitted(self, flow, name)

    def _name(self, request_id: str, caller: str | None) -> tuple[str, str] | None:
        """The caller's name for its request, checked; None when it chose none (or the frontend did)."""
        if caller is None or not request_id:
            return None
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id: {len(request_id)} characters, past the limit of {MAX_REQUEST_ID_CHARS}",
            )
        if (caller, request_id) in self._named:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id {request_id!r} is already in use by another of your requests in flight",
            )
        return caller, request_id

    def _left(self, name: tuple[str, str] | None) -> None:
        """A request leaves the queue: its place, and its caller's name for it, are free."""
        self.num_in_flight -= 1
        if name is not None:
            self._named.discard(name)

    def _record(self, flow: RequestFlow, code: grpc.StatusCode) -> None:
        model, m = flow.request.model.name, self.metrics
        m.requests.labels(model, code.name).inc()
        if flow.num_migrations:
            m.migrations.labels(model).inc(flow.num_migrations)
        if code == grpc.StatusCode.CANCELLED:  # the caller left: neither a latency nor a failure of ours
            return
        b, gaps = flow.report.breakdown, flow.report.token_gaps()
        ok = code == grpc.StatusCode.OK
        e2e_s = b.e2e_ms / 1e3 if ok else time.monotonic() - flow.arrival
        self.window.record(
            model,
            time.time() - e2e_s,
            ttft_s=b.ttft_ms / 1e3,
            itl_s=gaps or None,
            e2e_s=e2e_s,
            prompt_tokens=len(flow.request.token_ids),
            output_tokens=flow.num_tokens,
            ok=ok,
        )
        if not ok:
            return
        m.ttft_seconds.labels(model).observe(b.ttft_ms / 1e3)
        m.e2e_seconds.labels(model).observe(b.e2e_ms / 1e3)
        itl = m.itl_seconds.labels(model)
        for gap in gaps:
            itl.observe(gap)
        if b.disaggregated and b.ttft_ms > 0:
            m.kv_transfer_share.labels(model).observe(min(b.kv_transfer_ms / b.ttft_ms, 1.0))


class Admitted:
    """An admitted request: stream it with ``responses`` once, or ``release`` it unstreamed."""

    def __init__(self, gateway: Gateway, flow: RequestFlow, name: tuple[str, str] | None = None) -> None:
        self.gateway = gateway
        self.flow = flow
        self._name = name
        self._counted = True

    def release(self) -> None:
        """Give back its place in the queue without running it (a no-op once streamed)."""
        if self._counted:
            self._counted = False
            self.gateway._left(self._name)

    async def responses(self) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        """The flow's messages; raises FlowError. Closing it early (the client left) cancels
        the flow, which aborts the request on its workers and frees its blocks."""
        if not self._counted:
            raise RuntimeError(f"request {self.flow.request_id} was released or already streamed")
        code = grpc.StatusCode.CANCELLED  # unless it ends otherwise: the client went away
        try:
            async for response in self.flow.run():
                yield response
            code = grpc.StatusCode.OK
        except FlowError as exc:
            code = exc.code
            logger.info("request %s failed: %s %s", self.flow.request_id, exc.code.name, exc.message)
            raise
        finally:
            self.release()
            self.gateway._record(self.flow, code)
