"""The layout descriptor, the TP mapping and descriptor indices: pure, in one process."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from pdserve.kvtransfer.descriptors import SliceDescriptors, coalesce
from pdserve.kvtransfer.layout import KVLayout, LayoutMismatch, check_compatible
from pdserve.kvtransfer.messages import CompletionNotice, PeerInfo, decode_notice
from pdserve.kvtransfer.tp import HeadSlice, expected_notices, notify_set, sources
from pdserve.model.kv_cache import KVCacheSpec

GQA_SPEC = KVCacheSpec(num_layers=4, block_size=16, dtype=torch.bfloat16, is_mla=False, num_kv_heads=4, head_dim=64)
MLA_SPEC = KVCacheSpec(num_layers=4, block_size=16, dtype=torch.bfloat16, is_mla=True, latent_dim=576)


def gqa(tp_size: int = 1, tp_rank: int = 0, total_heads: int = 8, **overrides) -> KVLayout:
    layout = KVLayout.from_spec(GQA_SPEC, "llama", tp_size, tp_rank)
    return msgspec.structs.replace(layout, num_kv_heads=total_heads // tp_size, **overrides)


def mla(tp_size: int = 1, tp_rank: int = 0) -> KVLayout:
    return KVLayout.from_spec(MLA_SPEC, "deepseek", tp_size, tp_rank)


def test_layout_from_spec_and_round_trip():
    layout = KVLayout.from_spec(GQA_SPEC, "llama", 2, 1)
    assert layout.dtype == "bfloat16" and layout.num_kv_heads == 4 and layout.total_kv_heads == 8
    assert layout.bytes_per_block == GQA_SPEC.bytes_per_block
    assert mla().bytes_per_block == MLA_SPEC.bytes_per_block
    assert msgspec.msgpack.decode(layout.encode(), type=KVLayout) == layout
    with pytest.raises(ValueError):
        KVLayout.from_spec(GQA_SPEC, "llama", 2, 2)


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "other"),
        ("dtype", "float16"),
        ("block_size", 32),
        ("num_layers", 5),
        ("head_dim", 128),
        ("memory_layout", "blocks,layers,tokens,kv,heads,head_dim"),
        ("protocol_version", 2),
    ],
)
def test_each_differing_field_is_named(field, value):
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(gqa(), gqa(**{field: value}))
    assert info.value.field == field and field in str(info.value)


def test_an_fp8_cache_is_described_by_its_dtype_at_half_the_bytes():
    fp8_spec = KVCacheSpec(
        num_layers=4, block_size=16, dtype=torch.float8_e4m3fn, is_mla=False, num_kv_heads=4, head_dim=64
    )
    layout = KVLayout.from_spec(fp8_spec, "llama", 2, 1)
    assert (
        layout.dtype == "float8_e4m3fn"
        and layout.bytes_per_block * 2 == KVLayout.from_spec(GQA_SPEC, "llama", 2, 1).bytes_per_block
    )
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(layout, KVLayout.from_spec(GQA_SPEC, "llama", 2, 1))
    assert info.value.field == "dtype"


def test_tp_may_differ_but_total_heads_may_not():
    check_compatible(gqa(tp_size=2, tp_rank=1), gqa(tp_size=4, tp_rank=3))
    check_compatible(mla(tp_size=1), mla(tp_size=8, tp_rank=5))
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(gqa(total_heads=8), gqa(total_heads=16))
    assert info.value.field == "num_kv_heads"
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(gqa(), mla())
    assert info.value.field in ("memory_layout", "model", "is_mla")


@pytest.mark.parametrize("p_size,d_size", [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 2), (8, 1), (2, 8)])
def test_gqa_sources_cover_each_head_once_and_notices_add_up(p_size, d_size):
    owner = {}
    for r in range(d_size):
        local = gqa(d_size, r)
        for s in sources(local, p_size):
            for h in range(s.num_heads):
                global_head = r * local.num_kv_heads + s.local_head + h
                assert global_head == s.remote_rank * (8 // p_size) + s.remote_head + h
                assert global_head not in owner
                owner[global_head] = r
    assert sorted(owner) == list(range(8))
    for q in range(p_size):  # every prefill rank waits for exactly the ranks that notify it
        senders = [r for r in range(d_size) if q in notify_set(gqa(d_size, r), p_size)]
        assert len(senders) == expected_notices(q, gqa(d_size, 0), p_size) >= 1


@pytest.mark.parametrize("p_size,d_size", [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (3, 2)])
def test_mla_reads_one_rank_and_notifies_every_rank(p_size, d_size):
    for r in range(d_size):
        (s,) = sources(mla(d_size, r), p_size)
        assert s.num_heads is None and s.remote_rank in notify_set(mla(d_size, r), p_size)
    for q in range(p_size):
        senders = [r for r in range(d_size) if q in notify_set(mla(d_size, r), p_size)]
        assert len(senders) == expected_notices(q, mla(d_size, 0), p_size) >= 1


def test_coalesce_finds_runs_consecutive_on_both_sides():
    remote = np.array([5, 6, 7, 20, 21, 9])
    local = np.array([0, 1, 2, 3, 9, 10])
    assert coalesce(remote, local) == [(5, 0, 3), (20, 3, 1), (21, 9, 1), (9, 10, 1)]
    assert coalesce(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []


def _info(layout: KVLayout, num_blocks: int, base: int) -> PeerInfo:
    return PeerInfo(agent_name=f"a{base}", agent_metadata=b"", layout=layout, base_address=base, num_blocks=num_blocks)


def test_whole_block_indices_cover_runs_with_power_of_two_pieces():
    local, remote = _info(mla(), 100, 1 << 20), _info(mla(), 200, 1 << 30)
    descs = SliceDescriptors(local, remote, HeadSlice(0, 0, 0, None), max_run_blocks=8)
    block = mla().bytes_per_block
    remote_ids = np.array(list(range(50, 63)) + [7])  # a run of 13, then 1
    local_ids = np.array(list(range(10, 23)) + [99])
    local_idx, remote_idx, num_bytes = descs.indices(remote_ids, local_ids)
    assert num_bytes == 14 * block and len(local_idx) == 4  # 13 = 8 + 4 + 1, then 1
    covered = []
    for li, ri in zip(local_idx, remote_idx):
        l_addr, l_len, _ = descs.local_rows[li]
        r_addr, r_len, _ = descs.remote_rows[ri]
        assert l_len == r_len and l_len % block == 0
        for k in range(int(l_len) // block):
            covered.append(((int(r_addr) - (1 << 30)) // block + k, (int(l_addr) - (1 << 20)) // block + k))
    assert covered == list(zip(remote_ids.tolist(), local_ids.tolist()))
    with pytest.raises(ValueError):
        descs.indices(np.array([200]), np.array([0]))


def test_head_slice_indices_address_exactly_the_heads():
    local, remote = _info(gqa(2, 1), 10, 0), _info(gqa(1, 0), 20, 1 << 30)
    (s,) = sources(local.layout, 1)  # decode rank 1 of 2 reads heads 4..7 of the only rank
    descs = SliceDescriptors(local, remote, s)
    local_idx, remote_idx, _ = descs.indices(np.array([3]), np.array([5]))
    lay_r, lay_l = remote.layout, local.layout
    slab = lay_r.bytes_per_head_slab
    assert len(local_idx) == 2 * lay_r.num_layers
    for unit, (li, ri) in enumerate(zip(local_idx, remote_idx)):
        layer, kv = divmod(unit, 2)
        r_addr, r_len, _ = descs.remote_rows[ri]
        l_addr, l_len, _ = descs.local_rows[li]
        assert r_len == l_len == 4 * slab
        want_r = (1 << 30) + 3 * lay_r.bytes_per_block + ((layer * 2 + kv) * 8 + 4) * slab
        want_l = 5 * lay_l.bytes_per_block + ((layer * 2 + kv) * 4 + 0) * slab
        assert (int(r_addr), int(l_addr)) == (want_r, want_l)


def test_notice_round_trip_and_foreign_messages_ignored():
    notice = CompletionNotice("req-1", sender_rank=1, num_expected=2, ok=False, reason="deadline")
    assert decode_notice(notice.encode()) == notice
    assert decode_notice(b"not ours") is None
