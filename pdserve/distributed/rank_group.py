"""Starting a group of ranks together and tearing it down together.

Rank 0 lives in the process that owns the group (an ``LLM``, or a worker); it starts ranks
1..N-1 as child processes running ``python -m <entry_module>``, each handed its rank, the
rendezvous address and an opaque msgspec payload on stdin. Nothing is pickled. The group
meets on a TCP store rank 0 opens on an ephemeral port, within the rendezvous deadline.

A child that loses its parent exits (it polls its parent's pid), and every collective has the
group's timeout, so no rank outlives its group or waits on it forever.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from pdserve.distributed.channel import Channel
from pdserve.distributed.parallel_config import ParallelConfig
from pdserve.distributed.parallel_state import ParallelState, RankFailed

logger = logging.getLogger("pdserve.distributed")


class RankStart(msgspec.Struct, frozen=True, kw_only=True):
    """What a child rank reads on stdin: where to meet, who it is, and its program's payload."""

    rank: int
    config: ParallelConfig
    store_host: str
    store_port: int
    device: str  # "cpu" or "cuda"
    payload: bytes


class RankGroup:
    """Ranks 1..N-1 of a group, as child processes of rank 0, which owns them."""

    def __init__(
        self, config: ParallelConfig, entry_module: str, payload: bytes, device: str = "cpu", host: str = "127.0.0.1"
    ) -> None:
        self.config = config
        self.entry_module = entry_module
        self.payload = payload
        self.device = device
        self.host = host
        self.processes: list[subprocess.Popen] = []
        self.state: ParallelState | None = None

    def start(self) -> ParallelState:
        """Start the children and join the group as rank 0; raises ``RankFailed`` if the group
        does not form within the rendezvous deadline (the children are stopped then)."""
        config = self.config
        timeout = timedelta(seconds=config.rendezvous_timeout_s)
        store = dist.TCPStore(self.host, 0, config.world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        for rank in range(1, config.world_size):
            start = RankStart(
                rank=rank,
                config=config,
                store_host=self.host,
                store_port=store.port,
                device=self.device,
                payload=self.payload,
            )
            process = subprocess.Popen([sys.executable, "-m", self.entry_module], stdin=subprocess.PIPE)
            assert process.stdin is not None  # stdin=PIPE
            process.stdin.write(msgspec.msgpack.encode(start))
            process.stdin.close()
            self.processes.append(process)
        try:
            self._wait_for_children(store, time.monotonic() + config.rendezvous_timeout_s)
            self.state = join_group(0, config, store, self.device)
        except Exception as error:
            self.close()
            raise RankFailed(
                f"the group of {config.world_size} ranks did not form within {config.rendezvous_timeout_s:.0f} s: "
                f"{error}; ranks exited: {self.exit_codes()}"
            ) from error
        return self.state

    def _wait_for_children(self, store: dist.Store, deadline: float) -> None:
        """Until every child has reached the store; a child that exits first fails the start
        at once (rather than at the deadline, inside the process-group set-up)."""
        pending = set(range(1, self.config.world_size))
        while pending:
            pending = {rank for rank in pending if not store.check([_joined_key(rank)])}
            dead = self.dead_ranks()
            if dead:
                raise RankFailed(f"ranks {dead} exited before the group formed")
            if pending and time.monotonic() > deadline:
                raise RankFailed(f"ranks {sorted(pending)} did not reach the rendezvous")
            time.sleep(0.02)

    def exit_codes(self) -> dict[int, int | None]:
        """Each child rank's exit code (None: still running)."""
        return {rank: p.poll() for rank, p in enumerate(self.processes, start=1)}

    def dead_ranks(self) -> list[int]:
        return [rank for rank, code in self.exit_codes().items() if code is not None]

    def close(self, grace_s: float = 10.0) -> None:
        """Tear the group down: leave it, then give the children ``grace_s`` to exit before
        killing them. Safe to call twice."""
        if self.state is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.state = None
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        self.processes = []


def join_group(rank: int, config: ParallelConfig, store: dist.Store, device: str) -> ParallelState:
    """Initialize ``torch.distributed`` for ``rank`` and make the tensor-parallel subgroups.

    Every rank calls ``new_group`` for every subgroup in the same order, as it requires.
    """
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=config.world_size,
        timeout=timedelta(seconds=config.collective_timeout_s),
    )
    # Control messages (plans, results) are CPU tensors: a gloo group even where NCCL moves the rest.
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    tp = config.tensor_parallel_size
    tp_group = None
    for dp_rank in range(config.data_parallel_size):
        group = dist.new_group(list(range(dp_rank * tp, (dp_rank + 1) * tp)))
        if rank // tp == dp_rank:
            tp_group = group
    return ParallelState(
        rank=rank,
        config=config,
        channel=Channel(store),
        tp_group=tp_group if tp > 1 else None,
        ep_group=dist.group.WORLD if config.enable_expert_parallel else None,
        cpu_group=cpu_group,
    )


def start_group(config: ParallelConfig, entry_module: str, payload: bytes, device: str) -> RankGroup | None:
    """Start ranks 1..N-1 of ``config`` (``python -m entry_module``, handed ``payload``) and join
    the group as rank 0; None when the group is a single rank. ``device`` is an engine's device
    option (auto, cpu or cuda): the group runs gloo on CPU and NCCL on CUDA."""
    if config.world_size == 1:
        return None
    on_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    group = RankGroup(config, entry_module, payload, device="cuda" if on_cuda else "cpu")
    group.start()
    return group


def child_start() -> tuple[RankStart, ParallelState]:
    """In a child rank: read its start message, join the group, and watch the parent."""
    start = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=RankStart)
    _exit_with_parent()
    timeout = timedelta(seconds=start.config.rendezvous_timeout_s)
    store = dist.TCPStore(start.store_host, start.store_port, start.config.world_size, is_master=False, timeout=timeout)
    store.set(_joined_key(start.rank), "1")
    return start, join_group(start.rank, start.config, store, start.device)


def _joined_key(rank: int) -> str:
    return f"pdserve/joined/{rank}"


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)  # the owner is gone: nobody will tear this rank down

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
