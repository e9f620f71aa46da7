"""The planner as a service: every interval, read etcd, decide per model, act, publish.

One ``step`` reads the SLO targets, the frontends' stats and the workers' entries in one
pass, and for every model with an SLO (and a connector) it builds the interval's
``Observation``, lets that model's ``Planner`` decide, applies the decision through the
model's ``ScalingConnector`` and publishes it as JSON at ``registry.planner_key(model)``,
where ``pdserve status`` shows it. New knobs are stored at ``registry.knobs_key(model)``
(unless the connector only advises), where the model's workers and the frontends pick them
up (``knobs_store``); a model's
planner starts from the knobs stored there, or else from what the workers were started with.
The SLO targets are followed by etcd watch (listed at the first step, then kept current), so
a change is in force at the next step, without a restart; the interval's stats, workers and
knobs are read afresh at each step, one consistent look at what the interval observed. An etcd
outage skips steps (logged once); it never ends the service. ``metrics`` exports each planned
model's targets, wanted pool sizes and decisions (``observability.planner_metrics``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pdserve.discovery.etcd import MAX_CALL_TIMEOUT_S, EtcdConnection
from pdserve.discovery.etcd_auth import EtcdAuth
from pdserve.discovery.knobs import Knobs, list_knobs, put_knobs
from pdserve.discovery.registry import Role, list_workers, planner_key
from pdserve.discovery.retry import UNAVAILABLE, Outage
from pdserve.discovery.slo import SLOTargets
from pdserve.discovery.slo_store import SLO_PREFIX, decode_slos
from pdserve.discovery.watch import Follower, WatchedRange
from pdserve.observability.frontend_stats import list_frontend_stats
from pdserve.observability.planner_metrics import PlannerMetrics
from pdserve.planner.config import PlannerConfig
from pdserve.planner.deployed_knobs import deployed_knobs
from pdserve.planner.observer import observe
from pdserve.planner.planner import Decision, Planner
from pdserve.planner.profile import EngineProfile
from pdserve.planner.scaling import ScalingConnector

logger = logging.getLogger(__name__)


class PlannerService:
    """Plans every model that has SLO targets in etcd and a connector.

    ``connector_for(model)`` gives the connector that resizes the model's pools, or None to
    leave the model alone (another planner's, or one this deployment does not manage).
    """

    def __init__(
        self,
        etcd_url: str,
        profile: EngineProfile,
        connector_for: Callable[[str], ScalingConnector | None],
        config: PlannerConfig = PlannerConfig(),
        etcd_auth: EtcdAuth = EtcdAuth(),
    ) -> None:
        self.config = config
        self.profile = profile
        self._connector_for = connector_for
        self._etcd = EtcdConnection(etcd_url, MAX_CALL_TIMEOUT_S, etcd_auth)
        self._slos = WatchedRange.prefix(SLO_PREFIX)
        self._slo_follower = Follower(
            self._etcd,
            [self._slos],
            lambda *_: None,
            name="planner's SLO targets",
            logger=logger,
            start_timeout_s=MAX_CALL_TIMEOUT_S,
        )
        self._is_following = False
        self._planners: dict[str, Planner] = {}
        self._outage = Outage(logger)
        self.metrics = PlannerMetrics()

    async def run(self, stop: asyncio.Event) -> None:
        """Step every ``interval_s`` until ``stop`` is set."""
        try:
            while not stop.is_set():
                started = time.monotonic()
                await self.step()
                remaining = self.config.interval_s - (time.monotonic() - started)
                try:
                    async with asyncio.timeout(max(remaining, 0.0)):
                        await stop.wait()
                except TimeoutError:
                    pass
        finally:
            await self.close()

    def slo(self, model: str) -> SLOTargets | None:
        """The model's targets as the service's watch last saw them (None: none stored)."""
        return next((t for t in decode_slos(self._slos.kvs.values()) if t.model == model), None)

    async def close(self) -> None:
        """Stop following the SLO targets and close the connection to etcd."""
        await self._slo_follower.close()
        self._is_following = False
        await self._etcd.close()

    async def step(self) -> list[Decision]:
        """One interval: the decisions made (and applied), or none if etcd could not be read."""
        try:
            if not self._is_following:
                await self._slo_follower.start()
                self._is_following = True
            async with self._etcd.use() as client:
                frontends, workers, stored_knobs = await asyncio.gather(
                    list_frontend_stats(client, MAX_CALL_TIMEOUT_S),
                    list_workers(client, MAX_CALL_TIMEOUT_S),
                    list_knobs(client, MAX_CALL_TIMEOUT_S),
                )
        except UNAVAILABLE as exc:
            self._outage.failed(
                exc, "planner: etcd at %s unreachable, skipping intervals until it answers", self._etcd.url
            )
            return []
        self._outage.answered()
        slos = decode_slos(self._slos.kvs.values())
        now = time.time()
        decisions = []
        planned = set()
        for slo in slos:
            connector = self._connector_for(slo.model)
            if connector is None:
                continue
            planned.add(slo.model)
            planner = self._planners.get(slo.model)
            if planner is None:
                sizes = await connector.current()
                if sizes is None:  # unknown: what is registered now, within the bounds
                    ready = [w for w in workers if w.model == slo.model and not w.draining]
                    sizes = (
                        min(
                            max(sum(w.role is Role.PREFILL for w in ready), slo.min_prefill_replicas),
                            slo.max_prefill_replicas,
                        ),
                        min(
                            max(sum(w.role is Role.DECODE for w in ready), slo.min_decode_replicas),
                            slo.max_decode_replicas,
                        ),
                    )
                prefill, decode = sizes
                deployed = deployed_knobs(slo.model, workers, frontends)
                planner = Planner(
                    slo,
                    self.profile,
                    self.config,
                    prefill_replicas=prefill,
                    decode_replicas=decode,
                    knobs=deployed,
                    knobs_now=stored_knobs.get(slo.model),
                    knob_limits=deployed,
                )
                self._planners[slo.model] = planner
                logger.info(
                    "planning %s: %d prefill + %d decode replicas now; knobs %s",
                    slo.model,
                    prefill,
                    decode,
                    planner.knobs,
                )
            planner.set_slo(slo)
            before = (planner.prefill_replicas, planner.decode_replicas, planner.knobs)
            obs = observe(slo.model, frontends, workers, planner.knobs, now=now, interval_s=self.config.interval_s)
            decision = planner.observe(obs)
            self.metrics.planned(slo, planner.prefill_replicas, planner.decode_replicas)
            if decision is None:
                continue
            self.metrics.decided(slo.model, decision.peak_rate)
            if not await self._apply(connector, decision, before):
                del self._planners[slo.model]  # it re-reads what is deployed at the next step
            await self._publish(decision)
            decisions.append(decision)
        for model in set(self._planners) - planned:  # its SLO was removed: start afresh if it returns
            del self._planners[model]
            self.metrics.forget(model)
        return decisions

    async def _apply(self, connector: ScalingConnector, decision: Decision, before: tuple[int, int, Knobs]) -> bool:
        """Resize and retune where the decision differs from ``before``; False if that failed."""
        prefill, decode, knobs = before
        try:
            if (decision.prefill_replicas, decision.decode_replicas) != (prefill, decode):
                await connector.scale(decision.prefill_replicas, decision.decode_replicas)
            if decision.knobs != knobs and connector.applies_knobs:
                async with self._etcd.use() as client:
                    await put_knobs(client, decision.model, decision.knobs, MAX_CALL_TIMEOUT_S)
                await connector.set_knobs(decision.knobs)
        except Exception:  # the service outlives a connector (or etcd) failure
            logger.exception("%s: could not apply %s", decision.model, decision)
            return False
        return True

    async def _publish(self, decision: Decision) -> None:
        try:
            async with self._etcd.use() as client, asyncio.timeout(MAX_CALL_TIMEOUT_S):
                await client.put(planner_key(decision.model).encode(), decision.encode())
        except UNAVAILABLE as exc:
            logger.warning("%s: decision not published: %s", decision.model, exc)
