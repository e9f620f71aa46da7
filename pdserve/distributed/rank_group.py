"""Starting a group of ranks together and tearing it down together.

Rank 0 lives in the process that owns the group (an ``LLM``, or a worker). Each other rank
gets a ``RankStart``: its rank, the rendezvous address, the program to run
(``entry_module``) and that program's opaque msgspec payload. Nothing is pickled. Two modes:

- one host (no placement): rank 0 starts ranks 1..N-1 as child processes running
  ``python -m <entry_module>``, hands each its start on stdin, and the group meets on a TCP
  store rank 0 opens on an ephemeral loopback port;
- across hosts (a ``GroupPlacement``): ranks 1..N-1 are started by someone else, anywhere.
  Rank 0 opens the store on the placement's port on every address and leaves each rank's
  start in it; each rank fetches its own there (``pdserve.distributed.follower``).

Either way the group forms within the rendezvous deadline or rank 0 raises ``RankFailed``,
and from then on both modes run the same code. A child that loses its parent exits (it polls
its parent's pid); a rank on another host exits when rank 0's store goes away; and every
collective has the group's timeout, so no rank outlives its group or waits on it forever.
"""

from __future__ import annotations

import logging
import os
import signal
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
from pdserve.distributed.interfaces import pin_collectives_to
from pdserve.distributed.parallel_state import ParallelState, RankFailed
from pdserve.distributed.placement import GroupPlacement

logger = logging.getLogger("pdserve.distributed")


class RankStart(msgspec.Struct, frozen=True, kw_only=True):
    """What a child rank reads on stdin: where to meet, who it is, and its program's payload."""

    rank: int
    config: ParallelConfig
    store_host: str
    store_port: int
    device: str  # "cpu" or "cuda"
    entry_module: str  # the rank's program (a rank started elsewhere runs it by this name)
    payload: bytes


# Keys of the group's store. Rank 0 sets STOP_KEY when it tears a group across hosts down: a
# rank there has no parent to lose, so it watches for this key (or for the store to vanish).
STOP_KEY = "pdserve/stop"


def start_key(rank: int) -> str:
    return f"pdserve/start/{rank}"


def joined_key(rank: int) -> str:
    return f"pdserve/joined/{rank}"


class RankGroup:
    """Ranks 1..N-1 of a group: child processes of rank 0, which owns them, or (with a
    ``placement``) processes elsewhere that rank 0 meets and stops but does not own.

    ``host``: the address rank 0 advertises; with a placement its collectives use the
    interface that holds it."""

    def __init__(
        self,
        config: ParallelConfig,
        entry_module: str,
        payload: bytes,
        device: str = "cpu",
        host: str = "127.0.0.1",
        placement: GroupPlacement | None = None,
    ) -> None:
        self.config = config
        self.entry_module = entry_module
        self.payload = payload
        self.device = device
        self.host = host
        self.placement = placement
        self.processes: list[subprocess.Popen] = []
        self.state: ParallelState | None = None
        self.store: dist.TCPStore | None = None

    def start(self) -> ParallelState:
        """Start (or wait for) ranks 1..N-1 and join the group as rank 0; raises ``RankFailed``
        if the group does not form within the rendezvous deadline (children are stopped then)."""
        config = self.config
        timeout = timedelta(seconds=config.rendezvous_timeout_s)
        port = 0 if self.placement is None else self.placement.leader_port
        # Across hosts the store listens on every address (torch binds the master so).
        store_host = "127.0.0.1" if self.placement is None else self.host
        try:
            store = dist.TCPStore(
                store_host, port, config.world_size, is_master=True, timeout=timeout, wait_for_workers=False
            )
        except Exception as error:
            raise RankFailed(f"the group's rendezvous could not listen on port {port}: {error}") from error
        self.store = store
        for rank in range(1, config.world_size):
            start = RankStart(
                rank=rank,
                config=config,
                store_host=store_host,
                store_port=store.port,
                device=self.device,
                entry_module=self.entry_module,
                payload=self.payload,
            )
            if self.placement is None:
                self._start_child(start)
            else:
                store.set(start_key(rank), msgspec.msgpack.encode(start))  # type: ignore[arg-type]
        try:
            self._wait_for_ranks(store, time.monotonic() + config.rendezvous_timeout_s)
            # Ranks on one host meet over loopback: nothing of the group listens beyond it but the store.
            pin_collectives_to(store_host)
            self.state = join_group(0, config, store, self.device)
        except Exception as error:
            self.close()
            where = f"; ranks exited: {self.exit_codes()}" if self.placement is None else f" (port {port})"
            raise RankFailed(
                f"the group of {config.world_size} ranks did not form within "
                f"{config.rendezvous_timeout_s:.0f} s: {error}{where}"
            ) from error
        return self.state

    def _start_child(self, start: RankStart) -> None:
        process = subprocess.Popen([sys.executable, "-m", self.entry_module], stdin=subprocess.PIPE)
        assert process.stdin is not None  # stdin=PIPE
        process.stdin.write(msgspec.msgpack.encode(start))
        process.stdin.close()
        self.processes.append(process)

    def _wait_for_ranks(self, store: dist.Store, deadline: float) -> None:
        """Until every rank has reached the store; a child that exits first fails the start
        at once (rather than at the deadline, inside the process-group set-up)."""
        pending = set(range(1, self.config.world_size))
        while pending:
            pending = {rank for rank in pending if not store.check([joined_key(rank)])}
            dead = self.dead_ranks()
            if dead:
                raise RankFailed(f"ranks {dead} exited before the group formed")
            if pending and time.monotonic() > deadline:
                raise RankFailed(f"ranks {sorted(pending)} did not reach the rendezvous")
            time.sleep(0.02)

    def stop_ranks(self) -> None:
        """Ask ranks 1..N-1 to stop as a worker stops (SIGTERM): children by signal, ranks
        elsewhere through the store they watch."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        if self.placement is not None and self.store is not None:
            try:
                self.store.set(STOP_KEY, "1")
            except Exception:  # the store is rank 0's own: this fails only as the process ends
                logger.warning("could not tell the group's ranks to stop", exc_info=True)

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
    """Initialize ``torch.distributed`` for ``rank`` and make the group's subgroups.

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
    tp, dp = config.tensor_parallel_size, config.data_parallel_size
    tp_group = None
    for dp_rank in range(dp):
        group = dist.new_group(list(range(dp_rank * tp, (dp_rank + 1) * tp)))
        if rank // tp == dp_rank:
            tp_group = group
    # Control messages (step agreements, results) are CPU tensors: gloo even where NCCL moves the rest.
    dp_group = None
    if dp > 1:
        leaders = list(range(0, config.world_size, tp))
        dp_group = dist.group.WORLD if backend == "gloo" and tp == 1 else dist.new_group(leaders, backend="gloo")
    return ParallelState(
        rank=rank,
        config=config,
        tp_channel=Channel(store, f"tp{rank // tp}") if tp > 1 else None,
        dp_channel=Channel(store, "dp") if dp > 1 and rank % tp == 0 else None,
        tp_group=tp_group if tp > 1 else None,
        ep_group=dist.group.WORLD if config.enable_expert_parallel else None,
        dp_group=dp_group if dp > 1 and rank % tp == 0 else None,
    )


def group_device(device: str) -> str:
    """The device an engine's device option (auto, cpu or cuda) puts a group on."""
    return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"


def start_group(
    config: ParallelConfig,
    entry_module: str,
    payload: bytes,
    device: str,
    placement: GroupPlacement | None = None,
    host: str = "127.0.0.1",
) -> RankGroup | None:
    """Start ranks 1..N-1 of ``config`` (``python -m entry_module``, handed ``payload``), or with a
    ``placement`` wait for them to come, and join the group as rank 0; None when the group is a
    single rank. ``device`` is an engine's device option: the group runs gloo on CPU and NCCL on
    CUDA. ``host``: the address rank 0 advertises to ranks on other hosts."""
    if config.world_size == 1:
        return None
    group = RankGroup(config, entry_module, payload, device=group_device(device), host=host, placement=placement)
    group.start()
    return group


def child_start() -> tuple[RankStart, ParallelState]:
    """In a child rank: read its start message, join the group, and watch the parent."""
    start = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=RankStart)
    _exit_with_parent()
    timeout = timedelta(seconds=start.config.rendezvous_timeout_s)
    store = dist.TCPStore(start.store_host, start.store_port, start.config.world_size, is_master=False, timeout=timeout)
    store.set(joined_key(start.rank), "1")
    pin_collectives_to(start.store_host)
    return start, join_group(start.rank, start.config, store, start.device)


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)  # the owner is gone: nobody will tear this rank down

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
