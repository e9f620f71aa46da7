"""The characters tokenized at once: bounded in total, first come first served, refused past the wait."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from pdserve.frontend.catalog import InvalidRequest, ModelCatalog
from pdserve.frontend.char_budget import Busy, CharBudget
from pdserve.text.tokenizer import Tokenizer
from pdserve.v1 import inference_pb2
from tests.frontend.test_router import entry
from tests.utils.aio import run_scenario
from tests.utils.tiny_tokenizer import write_tiny_tokenizer


def test_prompts_wait_their_turn_within_the_budget_and_are_refused_past_the_wait():
    async def scenario():
        budget = CharBudget(100, wait_s=0.2)
        first = await budget.acquire(60)
        second = asyncio.ensure_future(budget.acquire(60))  # does not fit beside the first
        small = asyncio.ensure_future(budget.acquire(10))  # fits, but comes after: no overtaking
        await asyncio.sleep(0.05)
        assert not second.done() and not small.done() and budget.in_use == 60
        budget.release(first)
        assert (await second, await small, budget.in_use) == (60, 10, 70)
        with pytest.raises(Busy, match=r"the limit \(max_tokenizing_chars\) is 100"):
            await budget.acquire(50)
        cancelled = asyncio.ensure_future(budget.acquire(50))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        budget.release(60)
        budget.release(10)
        whole = await budget.acquire(10_000)  # larger than the budget: runs alone
        return whole, budget.in_use

    assert run_scenario(scenario()) == (100, 100)


def test_concurrent_prompts_tokenize_within_the_budget_and_a_prompt_that_cannot_fit_never_starts(tmp_path):
    write_tiny_tokenizer(tmp_path)
    longest = Tokenizer.from_pretrained(tmp_path).max_token_chars
    worker = msgspec.structs.replace(entry("d1", "decode"), model_path=str(tmp_path), max_model_len=100_000)
    text = "Hello, world! " * 2_000  # 28,000 characters

    async def scenario():
        budget = CharBudget(60_000, wait_s=30)
        catalog = ModelCatalog(budget=budget)
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, budget.in_use)
                await asyncio.sleep(0)

        watcher = asyncio.ensure_future(watch())
        prompts = [inference_pb2.GenerateRequest(text=text) for _ in range(6)]
        valid = await asyncio.gather(*(catalog.validate(p, [worker]) for p in prompts))
        watcher.cancel()
        too_long = inference_pb2.GenerateRequest(text="x" * (99_999 * longest + 1))
        with pytest.raises(InvalidRequest, match=r"context window \(max_model_len\) is 100000 tokens"):
            await catalog.validate(too_long, [worker])
        return valid, peak, budget.in_use

    valid, peak, left = run_scenario(scenario())
    assert len({len(v.token_ids) for v in valid}) == 1
    assert peak == 56_000 and left == 0  # two at a time, never three
