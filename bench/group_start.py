"""How long a worker group takes to start, to notice a lost rank, and to start again.

    python -m bench.group_start [--json] [--rounds N] [--model PATH] [--tensor-parallel-size 2]

One decode worker group of ``--tensor-parallel-size`` ranks on a real etcd, started as
``pdserve decode`` processes the way a user (or Kubernetes) starts them, alternating per round:

- ``local``: rank 0 starts the other ranks itself (one host);
- ``split``: every rank is its own process, meeting rank 0 at ``--leader-address`` (the mode of
  a group across hosts; here all on loopback), started at the same moment.

For each: ``start_s``, from launching the processes to rank 0's "listening" line (model load,
rendezvous, KV agents, registration). For ``split`` also, after it is up: ``rank_lost_s``, from
SIGKILL of the last rank to rank 0's exit (non-zero: the group fails as a whole);
``leader_lost_s``, from SIGKILL of rank 0 to the last rank's exit (a fresh group each); and
``restart_s``, the start of the whole group again after the loss. Medians over the rounds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lib.machine import describe
from bench.lib.report import emit, median
from bench.lib.watched import Watched
from pdserve.launch.etcd_process import find_etcd, free_port
from pdserve.model.default_model import resolve_model

# Past this a start or an exit counts as hung: the bench fails rather than waits on.
_DEADLINE_S = 300.0


class Rank:
    """One ``pdserve decode`` process, its output watched (so that the pipe never fills)."""

    def __init__(self, argv: list[str]) -> None:
        self.started = time.monotonic()
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output = Watched(self.process)

    def wait_listening(self) -> float:
        if not self.output.wait_listening(_DEADLINE_S):
            raise SystemExit("a group did not come up:\n" + self.output.tail())
        return time.monotonic() - self.started

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)

    def seconds_to_exit(self, since: float) -> tuple[float, int]:
        code = self.process.wait(_DEADLINE_S)
        return time.monotonic() - since, code


def start_group(args: argparse.Namespace, etcd: str, split: bool) -> list[Rank]:
    size = args.tensor_parallel_size
    base = [sys.executable, "-m", "pdserve", "decode", "--model", args.model, "--etcd", etcd]
    base += ["--tensor-parallel-size", str(size), "--num-threads", "1", "--metrics-port", "-1"]
    if not split:
        return [Rank(base)]
    port = free_port()
    place = ["--leader-address", f"127.0.0.1:{port}", "--group-size", str(size)]
    return [Rank([*base, *place, "--group-index", str(index)]) for index in range(size)]


def stop(ranks: list[Rank]) -> None:
    for rank in ranks:
        rank.kill()


def one_round(args: argparse.Namespace, etcd: str) -> dict[str, float]:
    result: dict[str, float] = {}
    ranks = start_group(args, etcd, split=False)
    try:
        result["local_start_s"] = ranks[0].wait_listening()
    finally:
        stop(ranks)
    ranks = start_group(args, etcd, split=True)
    try:
        result["split_start_s"] = ranks[0].wait_listening()
        killed = time.monotonic()
        ranks[-1].kill()
        result["rank_lost_s"], code = ranks[0].seconds_to_exit(killed)
        if code == 0:
            raise SystemExit("rank 0 exited 0 after losing a rank: the group should fail")
    finally:
        stop(ranks)
    ranks = start_group(args, etcd, split=True)
    try:
        result["restart_s"] = ranks[0].wait_listening()
        killed = time.monotonic()
        ranks[0].kill()
        result["leader_lost_s"], _ = ranks[-1].seconds_to_exit(killed)
    finally:
        stop(ranks)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.group_start", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model to serve (default: the default model)")
    parser.add_argument("--tensor-parallel-size", type=int, default=2, help="ranks of the group (default: 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each timing every case (default: 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    args.model = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="pdserve-group-start-") as tmp:
        client, peer = free_port(), free_port()
        etcd_argv = [str(find_etcd()), "--data-dir", str(Path(tmp) / "etcd")]
        etcd_argv += ["--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls"]
        etcd_argv += [f"http://127.0.0.1:{client}", "--listen-peer-urls", f"http://127.0.0.1:{peer}"]
        etcd = subprocess.Popen(etcd_argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            rounds = [one_round(args, f"http://127.0.0.1:{client}") for _ in range(args.rounds)]
        finally:
            etcd.kill()
            etcd.wait(10)
    report: dict[str, Any] = {
        "model": args.model,
        "tensor_parallel_size": args.tensor_parallel_size,
        "rounds": rounds,
        "median": {key: median([r[key] for r in rounds], 2) for key in rounds[0]},
        "machine": describe(),
    }
    emit(report, args.json, lambda r: print("\n".join(f"{k:>16}: {v:.2f} s" for k, v in r["median"].items())))


if __name__ == "__main__":
    main()
