"""PlannerService against a real etcd: reads SLOs, frontend stats and workers; decides, applies, publishes."""

from __future__ import annotations

import time
import uuid

import msgspec
import pytest

from pdserve.discovery.etcd import close_quietly, connect
from pdserve.discovery.knobs import Knobs, delete_knobs, get_knobs, put_knobs
from pdserve.discovery.registry import encode_entry, frontend_key, planner_key
from pdserve.discovery.slo import SLOTargets
from pdserve.discovery.slo_store import delete_slo, put_slo
from pdserve.observability.frontend_stats import FrontendStats, ModelStats
from pdserve.planner.config import PlannerConfig
from pdserve.planner.scaling import AdviseOnly
from pdserve.planner.service import PlannerService
from pdserve.types.engine_load import EngineLoad
from tests.conftest import OPERATOR_PASSWORD
from tests.discovery.test_registry import eventually, make_entry
from tests.planner.profiles import synthetic_profile
from tests.utils.aio import run_scenario


def test_an_itl_breach_grows_decode_and_the_decision_is_published_and_applied(etcd_url: str) -> None:
    model = f"org/plan-{uuid.uuid4().hex[:8]}"
    connector = AdviseOnly()

    async def scenario():
        client = await connect(etcd_url)
        # The session's etcd is shared: everything written here goes at the end (the lease takes
        # the worker entries and frontend stats with it).
        lease = await client.lease(60)
        try:
            await put_slo(client, SLOTargets(model=model, ttft_p90_s=1.0, itl_p90_s=0.05, max_decode_replicas=4))
            for worker_id, role in (("p", "prefill"), ("d", "decode")):
                entry = msgspec.structs.replace(make_entry(model, f"{worker_id}-{model}", role), load=EngineLoad())
                await client.put(entry.key.encode(), encode_entry(entry), lease=lease.id)
            # Light traffic whose observed ITL p90 (200 ms) is far over the 50 ms target.
            stats = ModelStats(
                window_s=1,
                num_requests=2,
                arrival_rate=1.0,
                arrivals_per_s=[1] * 5,
                ttft_p50_ms=20,
                ttft_p90_ms=30,
                itl_p50_ms=150,
                itl_p90_ms=200,
                prompt_tokens_mean=32,
                prompt_tokens_p50=32,
                prompt_tokens_p90=32,
                output_tokens_mean=16,
                output_tokens_p50=16,
                output_tokens_p90=16,
            )
            key = frontend_key(f"fe-{model}").encode()
            service = PlannerService(
                etcd_url,
                synthetic_profile(),
                lambda m: connector if m == model else None,
                PlannerConfig(interval_s=1, warmup_intervals=1),
            )
            decisions = []
            for _ in range(4):
                frontend = FrontendStats(frontend_id=f"fe-{model}", updated_at=time.time(), models={model: stats})
                await client.put(key, frontend.encode(), lease=lease.id)
                decisions += [d for d in await service.step() if d.model == model]
            await service.close()
            published = await client.get(planner_key(model).encode())
            return decisions, published, service.metrics.registry
        finally:
            await client.revoke_lease(lease.id)
            await delete_slo(client, model)
            await client.delete(planner_key(model).encode())
            await close_quietly(client)

    decisions, published, metrics = run_scenario(scenario())
    assert decisions and decisions[0].decode_replicas == 2 and decisions[0].prefill_replicas == 1
    assert any("ITL p90" in reason for reason in decisions[0].reasons)
    assert run_scenario(connector.current()) == (decisions[-1].prefill_replicas, decisions[-1].decode_replicas)
    assert published is not None
    last = msgspec.json.decode(published.value)
    assert last["decode_replicas"] == decisions[-1].decode_replicas and abs(last["time"] - time.time()) < 60
    # Its metrics: the targets it holds, the sizes it wants, the decisions it made.
    assert metrics.get_sample_value("pdserve_slo_itl_p90_seconds", {"model": model}) == 0.05
    assert metrics.get_sample_value("pdserve_slo_ttft_p90_seconds", {"model": model}) == 1.0
    wanted = metrics.get_sample_value("pdserve_planner_replicas", {"model": model, "role": "decode"})
    assert wanted == decisions[-1].decode_replicas
    assert metrics.get_sample_value("pdserve_planner_decisions_total", {"model": model}) == len(decisions)


def test_an_unreachable_etcd_skips_the_interval_without_raising() -> None:
    service = PlannerService("http://127.0.0.1:9", synthetic_profile(), lambda m: AdviseOnly())
    assert run_scenario(service.step()) == []


class Retuning(AdviseOnly):
    """Resizes nothing but lets the planner store knobs, and records what it mirrors."""

    applies_knobs = True

    def __init__(self) -> None:
        super().__init__()
        self.mirrored: list[Knobs] = []

    async def set_knobs(self, knobs: Knobs) -> None:
        self.mirrored.append(knobs)


@pytest.mark.parametrize("connector", [Retuning(), AdviseOnly()], ids=["retuning", "advise-only"])
def test_the_planner_starts_from_the_stored_knobs_and_stores_the_ones_it_decides(
    etcd_url: str, connector: AdviseOnly
) -> None:
    model = f"org/knobs-{uuid.uuid4().hex[:8]}"
    left = Knobs(decode_max_num_seqs=16, decode_max_num_batched_tokens=1024, local_prefill_threshold_tokens=256)

    async def scenario():
        client = await connect(etcd_url)
        lease = await client.lease(60)
        try:
            await put_slo(client, SLOTargets(model=model, ttft_p90_s=1.0, itl_p90_s=0.05, max_decode_replicas=4))
            await put_knobs(client, model, left)  # left by an earlier planner
            for worker_id, role in (("p", "prefill"), ("d", "decode")):
                entry = msgspec.structs.replace(
                    make_entry(model, f"{worker_id}-{model}", role),
                    load=EngineLoad(),
                    max_num_seqs=32,
                    max_num_batched_tokens=1024,
                )
                await client.put(entry.key.encode(), encode_entry(entry), lease=lease.id)
            # Light traffic far inside both targets: the knobs go back to the workers' start-up settings.
            stats = ModelStats(
                window_s=1,
                num_requests=2,
                arrival_rate=1.0,
                arrivals_per_s=[1] * 5,
                ttft_p50_ms=20,
                ttft_p90_ms=30,
                itl_p50_ms=5,
                itl_p90_ms=6,
                prompt_tokens_mean=32,
                prompt_tokens_p50=32,
                prompt_tokens_p90=32,
                output_tokens_mean=16,
                output_tokens_p50=16,
                output_tokens_p90=16,
            )
            service = PlannerService(
                etcd_url,
                synthetic_profile(),
                lambda m: connector if m == model else None,
                PlannerConfig(interval_s=1, warmup_intervals=1, down_cooldown_intervals=1),
            )
            decisions = []
            for _ in range(4):
                frontend = FrontendStats(
                    frontend_id=f"fe-{model}", updated_at=time.time(), models={model: stats}, local_prefill_tokens=64
                )
                await client.put(frontend_key(f"fe-{model}").encode(), frontend.encode(), lease=lease.id)
                decisions += [d for d in await service.step() if d.model == model]
            await service.close()
            return decisions, await get_knobs(client, model)
        finally:
            await client.revoke_lease(lease.id)
            await delete_slo(client, model)
            await delete_knobs(client, model)
            await client.delete(planner_key(model).encode())
            await close_quietly(client)

    decisions, stored = run_scenario(scenario())
    deployed = Knobs(
        decode_max_num_seqs=32,
        decode_max_num_batched_tokens=1024,
        prefill_chunk_size=1024,
        local_prefill_threshold_tokens=64,
    )
    assert decisions and decisions[-1].knobs == deployed, decisions
    assert any("local_prefill_threshold_tokens 256→64" in r for d in decisions for r in d.reasons)
    if isinstance(connector, Retuning):
        assert stored == deployed and connector.mirrored == [deployed]
    else:  # advice changes nothing
        assert stored == left


def test_the_planner_follows_slo_changes_by_watch(etcd_url: str) -> None:
    model = f"org/slo-{uuid.uuid4().hex[:8]}"

    async def scenario() -> list[float]:
        client = await connect(etcd_url)
        service = PlannerService(etcd_url, synthetic_profile(), lambda m: None)
        try:
            await service.step()  # lists the targets, then watches them
            seen = []
            for itl in (0.05, 0.03):
                await put_slo(client, SLOTargets(model=model, ttft_p90_s=1.0, itl_p90_s=itl))
                await eventually(
                    lambda: service.slo(model) is not None and service.slo(model).itl_p90_s == itl,
                    2.0,
                    f"the ITL target {itl}",
                )
                seen.append(service.slo(model).itl_p90_s)
            await delete_slo(client, model)
            await eventually(lambda: service.slo(model) is None, 2.0, "the targets removed")
            return seen
        finally:
            await service.close()
            await delete_slo(client, model)
            await close_quietly(client)

    assert run_scenario(scenario()) == [0.05, 0.03]


def test_under_etcd_auth_the_planner_role_reads_everything_and_publishes(secure_etcd) -> None:
    # Each party writes with its own role: the operator the SLO, a worker its entry, a frontend
    # its stats; the planner (known by its certificate) reads them all and publishes its decision.
    model = f"org/plan-auth-{uuid.uuid4().hex[:8]}"
    operator = secure_etcd.auth(user="operator", password=OPERATOR_PASSWORD)

    async def scenario():
        clients = {
            name: await connect(secure_etcd.url, 3.0, auth)
            for name, auth in (
                ("operator", operator),
                ("worker", secure_etcd.auth("pdserve-worker")),
                ("frontend", secure_etcd.auth("pdserve-frontend")),
            )
        }
        leases = {name: await clients[name].lease(60) for name in ("worker", "frontend")}
        try:
            await put_slo(clients["operator"], SLOTargets(model=model, ttft_p90_s=1.0, itl_p90_s=0.05))
            for worker_id, role in (("p", "prefill"), ("d", "decode")):
                entry = msgspec.structs.replace(make_entry(model, f"{worker_id}-{model}", role), load=EngineLoad())
                await clients["worker"].put(entry.key.encode(), encode_entry(entry), lease=leases["worker"].id)
            stats = ModelStats(
                window_s=1,
                num_requests=2,
                arrival_rate=1.0,
                arrivals_per_s=[1] * 5,
                ttft_p50_ms=20,
                ttft_p90_ms=30,
                itl_p50_ms=150,
                itl_p90_ms=200,
                prompt_tokens_mean=32,
                prompt_tokens_p50=32,
                prompt_tokens_p90=32,
                output_tokens_mean=16,
                output_tokens_p50=16,
                output_tokens_p90=16,
            )
            service = PlannerService(
                secure_etcd.url,
                synthetic_profile(),
                lambda m: AdviseOnly(),
                PlannerConfig(interval_s=1, warmup_intervals=1),
                secure_etcd.auth("pdserve-planner"),
            )
            decisions = []
            for _ in range(3):
                frontend = FrontendStats(frontend_id=f"fe-{model}", updated_at=time.time(), models={model: stats})
                await clients["frontend"].put(
                    frontend_key(f"fe-{model}").encode(), frontend.encode(), lease=leases["frontend"].id
                )
                decisions += [d for d in await service.step() if d.model == model]
            return decisions, await clients["operator"].get(planner_key(model).encode())
        finally:
            for name, lease in leases.items():
                await clients[name].revoke_lease(lease.id)
            await delete_slo(clients["operator"], model)
            for client in clients.values():
                await close_quietly(client)

    decisions, published = run_scenario(scenario())
    assert decisions and decisions[0].decode_replicas == 2
    assert published is not None and msgspec.json.decode(published.value)["decode_replicas"] >= 2
