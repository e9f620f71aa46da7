"""``pdserve knobs`` as an operator runs it: a real process against a real etcd."""

from __future__ import annotations

import json

import msgspec
import pytest

from pdserve.discovery.etcd import close_quietly, connect
from pdserve.discovery.knobs import LOCAL_PREFILL_THRESHOLD_TOKENS, delete_knobs
from tests.cli.test_operate import make_entry, pdserve, pdserve_async, registered
from tests.utils.aio import run_scenario


def _cleanup(etcd_url: str, model: str) -> None:
    async def delete():
        client = await connect(etcd_url)
        try:
            await delete_knobs(client, model)
        finally:
            await close_quietly(client)

    run_scenario(delete())


@pytest.mark.slow
def test_set_starts_from_the_workers_start_up_settings_then_show_and_reset(etcd_url: str, model: str) -> None:
    decode = msgspec.structs.replace(
        make_entry(model, f"d-{model}", "decode"), max_num_seqs=32, max_num_batched_tokens=512
    )
    prefill = msgspec.structs.replace(make_entry(model, f"p-{model}", "prefill"), max_num_batched_tokens=1024)

    async def scenario():
        async with registered(etcd_url, decode, prefill):
            before = await pdserve_async("knobs", "show", "--model", model, "--json", etcd=etcd_url)
            stored = await pdserve_async(
                "knobs",
                "set",
                "--model",
                model,
                "--decode-max-num-seqs",
                "64",
                "--local-prefill-threshold",
                "128",
                etcd=etcd_url,
            )
            after = await pdserve_async("knobs", "show", "--model", model, "--json", etcd=etcd_url)
            table = await pdserve_async("knobs", "show", etcd=etcd_url)
            reset = await pdserve_async("knobs", "reset", "--model", model, etcd=etcd_url)
            again = await pdserve_async("knobs", "show", "--model", model, "--json", etcd=etcd_url)
            return before, stored, after, table, reset, again

    try:
        before, stored, after, table, reset, again = run_scenario(scenario())
    finally:
        _cleanup(etcd_url, model)
    assert before.returncode == 0, before.stderr
    assert json.loads(before.stdout) == {
        "model": model,
        "source": "start-up",
        "decode_max_num_seqs": 32,
        "decode_max_num_batched_tokens": 512,
        "prefill_chunk_size": 1024,
        "local_prefill_threshold_tokens": LOCAL_PREFILL_THRESHOLD_TOKENS,  # no frontend reports one: the default
    }
    assert stored.returncode == 0, stored.stderr
    assert "decode_max_num_seqs 64 is capped at 32 on decode workers" in stored.stdout
    shown = json.loads(after.stdout)
    assert shown["source"] == "stored" and shown["decode_max_num_seqs"] == 64
    assert shown["local_prefill_threshold_tokens"] == 128 and shown["prefill_chunk_size"] == 1024  # the rest kept
    assert model in table.stdout and "LOCAL_PREFILL" in table.stdout
    assert reset.returncode == 0 and "start-up settings" in reset.stdout
    assert json.loads(again.stdout)["source"] == "start-up"


@pytest.mark.slow
def test_bad_values_and_empty_sets_are_refused_naming_the_field(etcd_url: str, model: str) -> None:
    bad = pdserve("knobs", "set", "--model", model, "--decode-max-num-seqs", "0", etcd=etcd_url)
    assert bad.returncode == 2 and "decode_max_num_seqs must be >= 1" in bad.stderr
    budget = pdserve(
        "knobs",
        "set",
        "--model",
        model,
        "--decode-max-num-seqs",
        "64",
        "--decode-max-num-batched-tokens",
        "8",
        etcd=etcd_url,
    )
    assert (
        budget.returncode == 2 and "decode_max_num_batched_tokens (8) must be >= decode_max_num_seqs" in budget.stderr
    )
    empty = pdserve("knobs", "set", "--model", model, etcd=etcd_url)
    assert empty.returncode == 2 and "nothing to set" in empty.stderr
    missing = pdserve("knobs", "reset", "--model", model, etcd=etcd_url)
    assert missing.returncode == 1 and f"no knobs stored for model {model!r}" in missing.stderr
    unknown = pdserve("knobs", "show", "--model", model, etcd=etcd_url)
    assert unknown.returncode == 1 and "no worker serves it" in unknown.stderr


def test_an_unreachable_etcd_fails_fast_naming_it() -> None:
    result = pdserve("knobs", "show", etcd="http://127.0.0.1:9", timeout=30)
    assert result.returncode == 1 and "127.0.0.1:9" in result.stderr
