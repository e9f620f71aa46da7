"""Request validation before routing: each bad field is named."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from pdserve.frontend.catalog import InvalidRequest, ModelCatalog, ModelUnavailable
from pdserve.v1 import inference_pb2
from tests.frontend.test_router import entry
from tests.utils.tiny_tokenizer import write_tiny_tokenizer


def request(**fields) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(**fields)


def validate(catalog: ModelCatalog, *args, **kwargs):
    return asyncio.run(catalog.validate(*args, **kwargs))


def test_models_are_summarised_with_their_tightest_limits():
    workers = [entry("p1", "prefill"), entry("d1", "decode"), entry("d2", "decode")]
    [info] = ModelCatalog.models(workers).values()
    assert (info.name, info.num_prefill, info.num_decode, info.vocab_size) == ("m", 1, 2, 100)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model": "other", "token_ids": inference_pb2.TokenIds(ids=[1])}, "model: 'other' is not served"),
        ({}, "prompt: set text or token_ids"),
        ({"token_ids": inference_pb2.TokenIds(ids=[])}, "prompt: empty"),
        ({"token_ids": inference_pb2.TokenIds(ids=[1, 100])}, "token_ids[1] = 100 is outside the vocabulary [0, 100)"),
        ({"token_ids": inference_pb2.TokenIds(ids=[1] * 1024)}, "max_model_len) is 1024"),
        (
            {
                "token_ids": inference_pb2.TokenIds(ids=[1] * 1000),
                "sampling": inference_pb2.SamplingOptions(max_tokens=25),
            },
            "sampling.max_tokens = 25 exceeds the room the context window leaves: max_model_len 1024 - 1000",
        ),
        (
            {"token_ids": inference_pb2.TokenIds(ids=[1]), "sampling": inference_pb2.SamplingOptions(top_k=-5)},
            "sampling.top_k",
        ),
        ({"text": "hi"}, "has no tokenizer.json; send token_ids"),
        (
            {"token_ids": inference_pb2.TokenIds(ids=[1]), "sampling": inference_pb2.SamplingOptions(json_schema="[")},
            "sampling.json_schema: not valid JSON",
        ),
        (
            {
                "token_ids": inference_pb2.TokenIds(ids=[1]),
                "sampling": inference_pb2.SamplingOptions(json_schema='{"type": "integer", "minimum": "zero"}'),
            },
            "sampling.json_schema: Expected f64 for 'minimum', got \"zero\"",
        ),
        (
            {"token_ids": inference_pb2.TokenIds(ids=[1]), "sampling": inference_pb2.SamplingOptions(regex="(a")},
            'sampling.regex: at 1(8): invalid regex "(a"',
        ),
        (
            {
                "token_ids": inference_pb2.TokenIds(ids=[1]),
                "sampling": inference_pb2.SamplingOptions(grammar="root ::= x"),
            },
            "sampling.grammar: Failed to convert the grammar from GBNF to Lark: Rule 'x' not found",
        ),
    ],
)
def test_bad_requests_name_the_field(fields, message):
    with pytest.raises(InvalidRequest) as error:
        validate(ModelCatalog(), request(**fields), [entry("d1", "decode")])
    assert message in str(error.value)


def test_no_workers_is_unavailable_and_several_models_need_a_name():
    with pytest.raises(ModelUnavailable):
        validate(ModelCatalog(), request(token_ids=inference_pb2.TokenIds(ids=[1])), [])
    other = msgspec.structs.replace(entry("d2", "decode"), model="n")
    with pytest.raises(InvalidRequest, match="model: required"):
        validate(ModelCatalog(), request(token_ids=inference_pb2.TokenIds(ids=[1])), [entry("d1", "decode"), other])


def test_a_valid_request_keeps_its_options_for_the_workers_less_the_stop_strings():
    options = inference_pb2.SamplingOptions(max_tokens=5, temperature=0.0, seed=3, stop=["\n\n"], stop_token_ids=[7])
    valid = validate(
        ModelCatalog(), request(token_ids=inference_pb2.TokenIds(ids=[4, 5]), sampling=options), [entry("d1", "decode")]
    )
    assert valid.token_ids == [4, 5] and valid.params.max_tokens == 5 and valid.params.seed == 3
    assert valid.params.stop == ["\n\n"]  # the frontend applies them to the text
    assert valid.options == inference_pb2.SamplingOptions(max_tokens=5, temperature=0.0, seed=3, stop_token_ids=[7])
    assert list(options.stop) == ["\n\n"]  # the caller's message is left as sent
    assert valid.tokenizer is None  # "/m" has no tokenizer.json


def test_a_text_prompt_past_max_prompt_chars_is_refused_before_it_is_tokenized():
    """The entry names no tokenizer: a prompt within the limit gets as far as asking for one."""
    catalog = ModelCatalog(max_prompt_chars=10)
    with pytest.raises(InvalidRequest, match=r"prompt: 11 characters, past the limit \(max_prompt_chars\) of 10"):
        validate(catalog, request(text="x" * 11), [entry("d1", "decode")])
    with pytest.raises(InvalidRequest, match="has no tokenizer.json"):
        validate(catalog, request(text="x" * 10), [entry("d1", "decode")])


def test_the_event_loop_stays_responsive_while_a_large_prompt_tokenizes(tmp_path):
    write_tiny_tokenizer(tmp_path)
    worker = msgspec.structs.replace(entry("d1", "decode"), model_path=str(tmp_path), max_model_len=10**7)

    async def scenario() -> tuple[float, float]:
        catalog = ModelCatalog()
        await catalog.preload("m", str(tmp_path))
        longest_gap, last = 0.0, time.monotonic()

        async def tick() -> None:
            nonlocal longest_gap, last
            while True:
                await asyncio.sleep(0.01)
                longest_gap, last = max(longest_gap, time.monotonic() - last), time.monotonic()

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0.05)  # ticking
        started = time.monotonic()
        await catalog.validate(request(text="Hello world, the quick brown fox. " * 10_000), [worker])
        took = time.monotonic() - started
        await asyncio.sleep(0.05)  # a tick after a blocked loop measures the block
        ticker.cancel()
        return took, longest_gap

    took, longest_gap = asyncio.run(scenario())
    # A loop blocked by the tokenization would stall for about all of it. The machine is shared
    # and noisy, so the bound is relative: no gap of half of it.
    assert took > 0.2 and longest_gap < took / 2, (took, longest_gap)


def test_concurrent_requests_share_one_read_of_the_tokenizer_which_preload_starts(tmp_path):
    write_tiny_tokenizer(tmp_path)
    worker = msgspec.structs.replace(entry("d1", "decode"), model_path=str(tmp_path))

    async def scenario():
        catalog = ModelCatalog()
        preloading = asyncio.ensure_future(catalog.preload("m", str(tmp_path)))
        first, second = await asyncio.gather(
            catalog.validate(request(text="Hello, world!"), [worker]),
            catalog.validate(request(token_ids=inference_pb2.TokenIds(ids=[1, 2])), [worker]),
        )
        await preloading
        later = await catalog.validate(request(token_ids=inference_pb2.TokenIds(ids=[3])), [worker])
        return first, second, later

    first, second, later = asyncio.run(scenario())
    assert first.tokenizer is not None and first.tokenizer is second.tokenizer is later.tokenizer  # read once
    assert first.token_ids == first.tokenizer.encode("Hello, world!", True)


def test_preload_of_a_model_without_a_tokenizer_is_quiet_and_requests_still_get_none(tmp_path):
    worker = msgspec.structs.replace(entry("d1", "decode"), model_path=str(tmp_path))

    async def scenario():
        catalog = ModelCatalog()
        await catalog.preload("m", str(tmp_path))
        return await catalog.validate(request(token_ids=inference_pb2.TokenIds(ids=[1])), [worker])

    assert asyncio.run(scenario()).tokenizer is None
