"""One rank's place in its group, and the collectives the model and the engine call.

Every collective here is called by every rank of its group in the same order: the step loop
guarantees it (each data-parallel rank's tensor-parallel leader plans its steps and sends the
plans to its other ranks over a ``Channel``; the data-parallel leaders agree on each step
first). A collective that fails (a rank died, or one outlived the group's timeout) raises
``RankFailed``: the group is finished and its owner tears it down.

Rank r is tensor-parallel rank ``r % tp`` of data-parallel rank ``r // tp``; expert
parallelism spans every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
import torch
import torch.distributed as dist

from pdserve.distributed.channel import Channel
from pdserve.distributed.errors import RankFailed
from pdserve.distributed.parallel_config import ParallelConfig

S = TypeVar("S", bound=msgspec.Struct)


@dataclass
class CollectiveStats:
    """Time this rank spent in each kind of collective (benchmarks read it; nothing else)."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        self.calls[kind] = self.calls.get(kind, 0) + 1


@dataclass(frozen=True)
class ParallelState:
    """Where this rank sits: its tensor-parallel, data-parallel and expert-parallel places.

    Groups are None where their size is 1, so that a single rank never touches
    ``torch.distributed``.
    """

    rank: int
    config: ParallelConfig
    # This data-parallel rank's tensor-parallel leader's step plans to its other ranks.
    tp_channel: Channel | None = None
    # Rank 0's commands to the data-parallel leaders (an offline ``LLM``'s prompts).
    dp_channel: Channel | None = None
    tp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None  # the whole group, on the device's backend
    # The data-parallel leaders over gloo: they agree on each step and gather results.
    dp_group: dist.ProcessGroup | None = None
    stats: CollectiveStats = field(default_factory=CollectiveStats)

    @property
    def plans(self) -> Channel:
        """``tp_channel``, in a tensor-parallel group (the only place it is used)."""
        assert self.tp_channel is not None, "a rank without tensor-parallel peers has no plans to share"
        return self.tp_channel

    @property
    def commands(self) -> Channel:
        """``dp_channel``, with data-parallel ranks (the only place it is used)."""
        assert self.dp_channel is not None, "a group without data-parallel ranks has no commands to share"
        return self.dp_channel

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def tp_size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_size(self) -> int:
        return self.config.data_parallel_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def ep_size(self) -> int:
        return self.config.ep_size

    @property
    def ep_rank(self) -> int:
        return self.rank if self.config.enable_expert_parallel else 0

    @property
    def is_driver(self) -> bool:
        """Rank 0: it schedules (or, with data-parallel attention, also gathers the results)."""
        return self.rank == 0

    @property
    def is_tp_leader(self) -> bool:
        """Tensor-parallel rank 0 of its data-parallel rank: it schedules that rank's steps."""
        return self.tp_rank == 0

    # -- tensor parallelism --------------------------------------------------------------

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the tensor-parallel ranks (in place; returned for chaining)."""
        if self.tp_group is not None:
            _timed(self.stats, "tp_all_reduce", dist.all_reduce, x, group=self.tp_group)
        return x

    def tp_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every tensor-parallel rank's ``x`` along the last dimension, in rank order."""
        if self.tp_group is None:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        _timed(self.stats, "tp_all_gather", dist.all_gather, parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    # -- expert parallelism ---------------------------------------------------------------

    def ep_all_to_all(
        self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Send rows ``x[sum(send_counts[:r]) : …+send_counts[r]]`` to expert-parallel rank r.

        Returns the rows received, grouped by source rank, and how many came from each (pass
        ``recv_counts`` when a previous exchange of the same split told them). Ranks with
        nothing to send take part all the same (a collective needs everyone).
        """
        group = self.ep_group
        if recv_counts is None:
            counts = torch.tensor(send_counts, dtype=torch.int64, device=x.device)
            received = torch.empty_like(counts)
            _timed(self.stats, "ep_all_to_all", dist.all_to_all_single, received, counts, group=group)
            recv_counts = received.tolist()
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        _timed(
            self.stats,
            "ep_all_to_all",
            dist.all_to_all_single,
            out,
            x.contiguous(),
            recv_counts,
            send_counts,
            group=group,
        )
        return out, recv_counts

    def ep_all_to_all_back(self, x: torch.Tensor, recv_counts: list[int], send_counts: list[int]) -> torch.Tensor:
        """The reverse of ``ep_all_to_all``: rows go back to the ranks they came from."""
        out = x.new_empty((sum(send_counts), *x.shape[1:]))
        _timed(
            self.stats,
            "ep_all_to_all",
            dist.all_to_all_single,
            out,
            x.contiguous(),
            send_counts,
            recv_counts,
            group=self.ep_group,
        )
        return out

    def ep_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the expert-parallel ranks (the whole group), in place."""
        if self.ep_group is not None:
            _timed(self.stats, "ep_all_reduce", dist.all_reduce, x, group=self.ep_group)
        return x

    # -- the whole group ------------------------------------------------------------------

    # -- the data-parallel leaders ----------------------------------------------------------

    def max_over_group(self, values: list[int]) -> list[int]:
        """Each of ``values`` at its largest over the data-parallel leaders (they agree on a
        step: whether anyone has tokens, whether anyone stays)."""
        if self.dp_group is None:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        _timed(self.stats, "dp_step_sync", dist.all_reduce, t, op=dist.ReduceOp.MAX, group=self.dp_group)
        return t.tolist()

    def gather_to_driver(self, message: S, type_: type[S]) -> list[S] | None:
        """Every data-parallel leader's ``message``, in data-parallel rank order, on rank 0
        (None on the others)."""
        if self.dp_group is None:
            return [message]
        payload = msgspec.msgpack.encode(message)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.dp_size)]
        _timed(
            self.stats,
            "gather",
            dist.all_gather,
            sizes,
            torch.tensor([len(payload)], dtype=torch.int64),
            group=self.dp_group,
        )
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.dp_size)] if self.is_driver else None
        _timed(self.stats, "gather", dist.gather, padded, parts, dst=0, group=self.dp_group)
        if parts is None:  # not the driver
            return None
        return [
            msgspec.msgpack.decode(part[: int(size.item())].numpy().tobytes(), type=type_)
            for part, size in zip(parts, sizes)
        ]


SINGLE_RANK = ParallelState(rank=0, config=ParallelConfig())


def _timed(stats: CollectiveStats, kind: str, collective, *args, **kwargs) -> None:
    start = time.perf_counter()
    try:
        collective(*args, **kwargs)
    except (RuntimeError, dist.DistBackendError) as error:
        raise RankFailed(f"{collective.__name__} failed: a rank of the group is gone or stuck ({error})") from error
    stats.add(kind, time.perf_counter() - start)
