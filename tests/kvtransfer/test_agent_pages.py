"""A KV agent says at start-up when its cache is not on huge pages, and how to enable them."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.kvtransfer import KVAgent, KVLayout
from pdserve.model import kv_cache
from pdserve.model.kv_cache import KVCache, KVCacheSpec
from tests.utils.aio import run_scenario

SPEC = KVCacheSpec(num_layers=2, block_size=4, dtype=torch.float32, is_mla=False, num_kv_heads=2, head_dim=8)


def started_agent_warnings(name: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    agent = KVAgent(name, KVCache(SPEC, 8, torch.device("cpu")), KVLayout.from_spec(SPEC, "m"))

    async def body() -> None:
        await agent.start()
        await agent.close()

    with caplog.at_level(logging.WARNING, logger="pdserve.kvtransfer.agent"):
        run_scenario(body(), 60)
    return [r.getMessage() for r in caplog.records if r.name == "pdserve.kvtransfer.agent"]


def test_an_agent_on_small_pages_warns_with_the_reason_and_the_fix(tmp_path, monkeypatch, caplog):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(kv_cache, "THP_SETTING", setting)
    (warning,) = started_agent_warnings("small-pages", caplog)
    assert "small-pages" in warning and "half the speed" in warning
    assert f"transparent huge pages are off ({setting}" in warning
    assert "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled" in warning


@pytest.mark.skipif(
    not kv_cache.THP_SETTING.exists() or "[never]" in kv_cache.THP_SETTING.read_text(),
    reason="no transparent huge pages here",
)
def test_an_agent_on_huge_pages_says_nothing(caplog):
    assert started_agent_warnings("huge-pages", caplog) == []
