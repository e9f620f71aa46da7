"""The step limits are checked once (``check_step_limits``), by every struct that holds them."""

from __future__ import annotations

import pytest

from pdserve.discovery.knobs import Knobs
from pdserve.engine.scheduler import SchedulerConfig
from pdserve.types.engine_config import EngineConfig, check_step_limits

BUILDERS = {
    "EngineConfig": lambda seqs, tokens: EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens),
    "SchedulerConfig": lambda seqs, tokens: SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens),
    "Knobs": lambda seqs, tokens: Knobs(decode_max_num_seqs=seqs, decode_max_num_batched_tokens=tokens),
}


@pytest.mark.parametrize("build", BUILDERS.values(), ids=BUILDERS.keys())
def test_a_step_budget_below_the_running_requests_is_refused(build) -> None:
    build(8, 8)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(7\) must be >= (decode_)?max_num_seqs \(8\)"):
        build(8, 7)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        build(0, 8)


def test_the_prefix_names_the_callers_fields() -> None:
    with pytest.raises(ValueError, match=r"^decode_max_num_batched_tokens \(1\) must be >= decode_max_num_seqs \(2\)"):
        check_step_limits(2, 1, prefix="decode_")
