"""ParallelConfig refuses shapes that cannot work, naming the option."""

from __future__ import annotations

import pytest

from pdserve.distributed.parallel_config import ParallelConfig


def test_world_and_expert_ranks():
    config = ParallelConfig(data_parallel_size=4, enable_expert_parallel=True)
    assert (config.world_size, config.ep_size) == (4, 4)
    assert ParallelConfig(tensor_parallel_size=2).ep_size == 1
    # Tensor parallelism inside data-parallel ranks: the experts span all of them.
    both = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    assert (both.world_size, both.ep_size) == (4, 4)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
        (dict(data_parallel_size=2), "set enable_expert_parallel"),
        (dict(num_redundant_experts=2), "need enable_expert_parallel"),
        (dict(enable_expert_parallel=True, num_redundant_experts=-1), "num_redundant_experts must be >= 0"),
        (dict(rendezvous_timeout_s=0), "must be > 0"),
    ],
)
def test_bad_shapes_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)
