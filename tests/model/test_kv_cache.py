"""The KV cache's host memory: zeroed, owned by the tensor, and on huge pages where the kernel allows."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from pdserve.model import kv_cache
from pdserve.model.kv_cache import KVCache, KVCacheSpec

SPEC = KVCacheSpec(num_layers=4, block_size=16, dtype=torch.float32, is_mla=False, num_kv_heads=2, head_dim=64)
NUM_BLOCKS = 512  # 32 MiB: several whole 2 MiB pages
THP_SETTING = kv_cache.THP_SETTING


def _huge_page_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and ":" not in first:  # a mapping's header: "start-end perms ..."
            start, end = (int(part, 16) for part in first.split("-"))
            inside = start <= address < end
        elif inside and first == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_cache_starts_zeroed_and_keeps_its_shape_and_dtype():
    cache = KVCache(SPEC, NUM_BLOCKS, torch.device("cpu"))
    assert cache.data.shape == SPEC.shape(NUM_BLOCKS) and cache.data.dtype == torch.float32
    assert cache.data.is_contiguous() and not cache.data.any()
    assert cache.nbytes == NUM_BLOCKS * SPEC.bytes_per_block
    cache.layer(3)[5].fill_(2.0)
    assert cache.data.sum() == 2.0 * SPEC.bytes_per_block // SPEC.num_layers // 4


def test_fp8_caches_are_zeroed_bytes_too():
    spec = KVCacheSpec(num_layers=2, block_size=16, dtype=torch.float8_e4m3fn, is_mla=True, latent_dim=576)
    cache = KVCache(spec, 8, torch.device("cpu"))
    assert cache.data.dtype == torch.float8_e4m3fn and not cache.data.float().any()


def test_the_memory_outlives_every_reference_but_the_cache_tensor():
    data = KVCache(SPEC, NUM_BLOCKS, torch.device("cpu")).data
    gc.collect()
    data.fill_(1.0)  # would fault if the mapping had gone with the KVCache
    assert data[-1, -1, -1, -1, -1, -1] == 1.0


@pytest.mark.skipif(
    not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(), reason="no transparent huge pages here"
)
def test_the_cache_is_on_huge_pages():
    cache = KVCache(SPEC, NUM_BLOCKS, torch.device("cpu"))
    # Most of 32 MiB: only a partial 2 MiB page at either end of the mapping may be small pages.
    assert _huge_page_kib(cache.data.data_ptr()) >= 28 * 1024


@pytest.mark.skipif(
    not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(), reason="no transparent huge pages here"
)
def test_a_cache_on_huge_pages_gives_no_reason():
    assert KVCache(SPEC, 8, torch.device("cpu")).small_pages_reason is None


@pytest.mark.parametrize(
    ("setting", "reason"),
    [("always madvise [never]\n", "transparent huge pages are off"), (None, "a kernel without transparent huge pages")],
)
def test_a_host_without_huge_pages_still_gets_a_zeroed_cache_and_the_reason(tmp_path, monkeypatch, setting, reason):
    fake = tmp_path / "enabled"
    if setting is not None:
        fake.write_text(setting)
    monkeypatch.setattr(kv_cache, "THP_SETTING", fake)
    cache = KVCache(SPEC, NUM_BLOCKS, torch.device("cpu"))
    assert cache.small_pages_reason is not None and reason in cache.small_pages_reason
    assert str(fake) in cache.small_pages_reason
    assert not cache.data.any()
