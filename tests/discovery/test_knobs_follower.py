"""KnobsFollower against a real etcd, reading the model's key itself or through a RegistryView:
each change applied once, deletion, bad values, failures."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from pdserve.discovery.etcd import EtcdConnection, close_quietly, connect
from pdserve.discovery.knobs import Knobs, delete_knobs, put_knobs
from pdserve.discovery.knobs_follower import KnobsFollower
from pdserve.discovery.registry import knobs_key
from pdserve.discovery.registry_view import RegistryView
from tests.discovery.test_registry import eventually
from tests.utils.aio import run_scenario


def _model() -> str:
    return f"org/follow-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("source", ["etcd", "view"])
def test_the_follower_applies_each_change_once_and_none_when_deleted(etcd_url: str, source: str) -> None:
    model = _model()
    applied: list[Knobs | None] = []

    async def apply(knobs: Knobs | None) -> None:
        applied.append(knobs)

    async def scenario():
        client = await connect(etcd_url)
        etcd = EtcdConnection(etcd_url)
        view = RegistryView(etcd)  # a decode worker's: its watch serves the follower too
        if source == "view":
            await view.start()
            follower = KnobsFollower.from_view(view, model, apply)
        else:
            follower = KnobsFollower.from_etcd(etcd, model, apply)
        await follower.start()
        try:
            first, second = Knobs(decode_max_num_seqs=4), Knobs(decode_max_num_seqs=2)
            await put_knobs(client, model, first)
            await eventually(lambda: applied == [first], 5, "the first knobs applied")
            await client.put(knobs_key(model).encode(), b"not json")  # kept: the last good knobs stay
            await asyncio.sleep(0.5)
            await put_knobs(client, model, second)
            await eventually(lambda: applied == [first, second], 5, "the second knobs applied")
            await delete_knobs(client, model)
            await eventually(lambda: applied == [first, second, None], 5, "back to start-up settings")
            await asyncio.sleep(0.3)  # no change: nothing more applied
        finally:
            await follower.close()
            await view.close()
            await etcd.close()
            await delete_knobs(client, model)
            await close_quietly(client)

    run_scenario(scenario())
    assert applied == [Knobs(decode_max_num_seqs=4), Knobs(decode_max_num_seqs=2), None]


def test_the_follower_outlives_an_apply_that_fails(etcd_url: str) -> None:
    model = _model()
    calls: list[Knobs | None] = []

    async def apply(knobs: Knobs | None) -> None:
        calls.append(knobs)
        if len(calls) == 1:
            raise RuntimeError("the engine refused")

    async def scenario():
        client = await connect(etcd_url)
        etcd = EtcdConnection(etcd_url)
        follower = KnobsFollower.from_etcd(etcd, model, apply)
        await follower.start()
        try:
            await put_knobs(client, model, Knobs(decode_max_num_seqs=4))
            await eventually(lambda: len(calls) == 1, 5, "the first apply")
            await put_knobs(client, model, Knobs(decode_max_num_seqs=3))
            await eventually(lambda: len(calls) == 2, 5, "the next change applied after a failure")
        finally:
            await follower.close()
            await etcd.close()
            await delete_knobs(client, model)
            await close_quietly(client)

    run_scenario(scenario())
    assert calls == [Knobs(decode_max_num_seqs=4), Knobs(decode_max_num_seqs=3)]
