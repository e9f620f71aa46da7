"""Engine profiles: interpolation, validation, JSON; and measuring a real (tiny) engine."""

import pytest

from pdserve.engine.engine import LLMEngine
from pdserve.planner.profile import DecodeGrid, EngineProfile, PrefillPoint
from pdserve.planner.profiler import ProfilePlan, profile_engine
from pdserve.types.engine_config import EngineConfig
from tests.planner.profiles import synthetic_profile


def test_prefill_interpolates_and_extrapolates():
    profile = synthetic_profile()  # (64, 10 ms), (512, 55 ms), (2048, 210 ms)
    assert profile.prefill_seconds(0) == 0.0
    assert profile.prefill_seconds(10) == pytest.approx(0.010)  # no cheaper than the shortest measured
    assert profile.prefill_seconds(288) == pytest.approx(0.0325)
    assert profile.prefill_seconds(4096) == pytest.approx(0.21 + 2048 * (0.155 / 1536))
    assert profile.prefill_tokens_per_s(512) == pytest.approx(512 / 0.055)


def test_decode_interpolates_bilinearly_on_the_grid():
    profile = synthetic_profile()
    assert profile.decode_step_seconds(0, 0) == 0.0
    assert profile.decode_step_seconds(16, 16 * 1024) == pytest.approx(0.022)
    assert profile.decode_step_seconds(16, 16 * 576) == pytest.approx(0.018)
    assert profile.decode_step_seconds(40, 40 * 128) == pytest.approx((0.014 + 0.025) / 2)
    assert profile.decode_step_seconds(1, 10) == pytest.approx(0.010)  # short contexts cost no less
    assert profile.decode_step_seconds(64, 64 * 2048) > 0.06  # extrapolated beyond the grid


def test_validation_and_json(tmp_path):
    with pytest.raises(ValueError, match="ascending"):
        EngineProfile(**_fields(prefill=[PrefillPoint(512, 0.05), PrefillPoint(64, 0.01)]))
    with pytest.raises(ValueError, match="grid"):
        DecodeGrid(batches=[1, 2], context_per_seq=[10], seconds=[[0.01]])
    profile = synthetic_profile()
    profile.save(tmp_path / "p.json")
    assert EngineProfile.load(tmp_path / "p.json") == profile
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json"):
        EngineProfile.load(tmp_path / "bad.json")


def _fields(**changes):
    profile = synthetic_profile()
    fields = {name: getattr(profile, name) for name in EngineProfile.__struct_fields__}
    return fields | changes


def test_profiles_a_tiny_llama(checkpoints, tmp_path):
    path, _ = checkpoints("llama")
    engine = LLMEngine(str(path), EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, seed=0))
    plan = ProfilePlan(prompt_lengths=(16, 128, 480), batch_sizes=(1, 4, 16), context_lengths=(32, 128), decode_steps=4)
    profile = profile_engine(engine, plan, source="test")
    engine.check_idle_integrity()
    assert [p.tokens for p in profile.prefill] == [16, 128, 480]
    # 30x the tokens costs more (the fastest of two rounds: a busy machine only adds time).
    assert profile.prefill[-1].seconds > profile.prefill[0].seconds
    assert profile.decode.batches == [1, 4, 16] and profile.decode.context_per_seq == [35, 131]
    assert all(s > 0 for row in profile.decode.seconds for s in row)
    assert profile.kv_capacity_tokens == engine.block_pool.num_blocks * engine.config.block_size
    assert profile.max_num_seqs == 16 and profile.kv_bytes_per_token == engine.kv_cache_spec.bytes_per_token
    profile.save(tmp_path / "tiny.json")
    assert EngineProfile.load(tmp_path / "tiny.json") == profile


def test_a_plan_the_engine_cannot_hold_is_refused(checkpoints):
    path, _ = checkpoints("llama")
    engine = LLMEngine(str(path), EngineConfig(max_num_seqs=4, max_num_batched_tokens=256))
    with pytest.raises(ValueError, match="prompt length 600"):
        profile_engine(engine, ProfilePlan(prompt_lengths=(600,)))
    with pytest.raises(ValueError, match="decode batch 8"):
        profile_engine(engine, ProfilePlan(prompt_lengths=(16,), batch_sizes=(8,)))
