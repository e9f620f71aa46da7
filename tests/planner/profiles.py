"""A small synthetic engine profile with round numbers, for planner and simulator tests."""

from pdserve.planner.profile import DecodeGrid, EngineProfile, PrefillPoint


def synthetic_profile() -> EngineProfile:
    """Prefill about 0.1 ms a token plus 4 ms a step; decode 10 ms at one sequence, rising
    with the batch and its context."""
    return EngineProfile(
        name="synthetic",
        source="tests/planner/profiles.py",
        prefill=[PrefillPoint(64, 0.010), PrefillPoint(512, 0.055), PrefillPoint(2048, 0.21)],
        decode=DecodeGrid(
            batches=[1, 16, 64],
            context_per_seq=[128, 1024],
            seconds=[[0.010, 0.011], [0.014, 0.022], [0.025, 0.060]],
        ),
        kv_capacity_tokens=200_000,
        kv_bytes_per_token=1024,
        max_num_seqs=64,
    )
