"""Live knobs in a real etcd: the store round trip, bad values, and what is deployed."""

from __future__ import annotations

import uuid

import msgspec
import pytest

from pdserve.discovery.etcd import close_quietly, connect
from pdserve.discovery.knobs import Knobs, delete_knobs, get_knobs, list_knobs, put_knobs
from pdserve.discovery.registry import knobs_key
from pdserve.observability.frontend_stats import FrontendStats
from pdserve.planner.deployed_knobs import deployed_knobs
from tests.discovery.test_registry import make_entry
from tests.utils.aio import run_scenario


def _model() -> str:
    return f"org/knobs-{uuid.uuid4().hex[:8]}"  # a slash: the key must stay one segment


def test_knobs_round_trip_and_delete(etcd_url: str) -> None:
    model = _model()
    knobs = Knobs(decode_max_num_seqs=8, decode_max_num_batched_tokens=256, local_prefill_threshold_tokens=32)

    async def scenario():
        client = await connect(etcd_url)
        try:
            assert await get_knobs(client, model) is None
            await put_knobs(client, model, knobs)
            stored, listed = await get_knobs(client, model), await list_knobs(client)
            deleted, again = await delete_knobs(client, model), await delete_knobs(client, model)
            return stored, listed, deleted, again, await get_knobs(client, model)
        finally:
            await close_quietly(client)

    stored, listed, deleted, again, after = run_scenario(scenario())
    assert stored == knobs and listed[model] == knobs
    assert deleted and not again and after is None


def test_a_bad_stored_value_is_an_error_naming_the_key_and_is_skipped_in_lists(etcd_url: str) -> None:
    model = _model()

    async def scenario():
        client = await connect(etcd_url)
        try:
            await client.put(knobs_key(model).encode(), b'{"decode_max_num_seqs": 0}')
            listed = await list_knobs(client)
            with pytest.raises(ValueError, match=f"{knobs_key(model)}.*decode_max_num_seqs must be >= 1"):
                await get_knobs(client, model)
            return listed
        finally:
            await client.delete(knobs_key(model).encode())
            await close_quietly(client)

    assert model not in run_scenario(scenario())


def test_deployed_knobs_are_the_tightest_start_up_budgets_of_each_pool() -> None:
    def worker(worker_id: str, role: str, seqs: int, tokens: int):
        return msgspec.structs.replace(
            make_entry("m", worker_id, role), max_num_seqs=seqs, max_num_batched_tokens=tokens
        )

    workers = [
        worker("d1", "decode", 32, 1024),
        worker("d2", "decode", 16, 2048),
        worker("p1", "prefill", 64, 4096),
        worker("other", "decode", 1, 1),
    ]
    workers[-1] = msgspec.structs.replace(workers[-1], model="another")
    frontends = [
        FrontendStats(frontend_id="a", updated_at=0.0, local_prefill_tokens=128),
        FrontendStats(frontend_id="b", updated_at=0.0, local_prefill_tokens=None),
    ]
    assert deployed_knobs("m", workers, frontends) == Knobs(
        decode_max_num_seqs=16,
        decode_max_num_batched_tokens=1024,
        prefill_chunk_size=4096,
        local_prefill_threshold_tokens=128,
    )
    assert deployed_knobs("m", workers, frontends[1:]).local_prefill_threshold_tokens == 0  # none conditional
    assert deployed_knobs("nobody", workers, []) == Knobs()
