"""Chaos soak: a deployment under steady load while workers are killed and paused and etcd restarts.

It starts a real etcd (``EtcdProcess``, the registry ``pdserve up`` runs: loopback, its own data
directory) and a deployment with ``LocalCluster``, the code behind ``pdserve up`` (frontend and
workers as child processes), and runs a closed loop
of ``--concurrency`` greedy streams for ``--duration`` seconds. Meanwhile, every
``--fault-interval`` seconds on average (exponential gaps, ``--seed``), one fault:

  kill   SIGKILL a worker; the cluster's supervisor (as in ``pdserve up``) restarts it after
         its back-off (``--restart-delay`` for the first crash in a row, doubling after);
  pause  SIGSTOP a worker for 1 s to twice the transfer deadline, then SIGCONT;
  etcd   stop etcd and start it again on the same ports and data (leases survive).

A worker is a victim only while another of its role is up and running, so the deployment can
always serve. Every request has a deadline (``--deadline``); one that has not ended
``HANG_GRACE_S`` after it counts as hung. Afterwards every paused worker is resumed, the load
stops, and once the workers are idle each one's KV blocks still used or pinned are read from
its /metrics: leaked blocks, which must be 0.

Reported (``--json``: one object): requests sent, completed, migrated (completed after at least
one migration), failed by cause (``deadline``: DEADLINE_EXCEEDED; ``migrations``: UNAVAILABLE
after the migration attempts ran out; anything else is ``unexplained``, with its message),
hung; leaked blocks per surviving worker; faults and restarts; p99 TTFT of the requests that
began during a fault (from its start until its worker is back, or etcd is) and of the others.

    python -m bench.chaos --duration 600 --json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.lib.checkpoints import SMOKE, write_checkpoint
from bench.lib.deploy import Deployment, DeploySpec
from bench.lib.load import BenchRequest, RequestResult, SamplingSpec, inference_stub, requests_until, run_lanes
from bench.lib.report import emit, nearest_rank
from pdserve.discovery.etcd import EtcdConnection
from pdserve.discovery.registry import Role, WorkerEntry
from pdserve.discovery.registry_view import RegistryView
from pdserve.launch.etcd_process import EtcdProcess
from pdserve.launch.local_cluster import Child, LocalCluster
from pdserve.launch.supervisor import RestartPolicy

MODEL = "chaos"
HANG_GRACE_S = 15.0  # past its deadline, a request still open is hung
IDLE_TIMEOUT_S = 60.0  # after the load: how long the workers get to be idle and whole
RESTART_TIMEOUT_S = 120.0  # how long a killed worker's restart may take (back-off, model load)


@dataclass
class Chaos:
    """The faults injected, each as (kind, target, start, end) once over, and the restarts done."""

    windows: list[tuple[str, str, float, float]] = field(default_factory=list)
    worker_restarts: int = 0
    etcd_restarts: int = 0
    stopped: set[int] = field(default_factory=set)  # pids paused now
    restarting: set[str] = field(default_factory=set)  # workers killed and not serving again yet
    tasks: set[asyncio.Task[None]] = field(default_factory=set)  # resumes and restarts under way

    def during(self, at: float) -> bool:
        return any(start <= at <= end for _, _, start, end in self.windows)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory (default: a tiny random Llama written to a temp dir)")
    parser.add_argument("--prefill", type=int, default=2, help="prefill workers (default: 2)")
    parser.add_argument("--decode", type=int, default=2, help="decode workers (default: 2)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (default: 60)")
    parser.add_argument("--concurrency", type=int, default=6, help="streams in flight (default: 6)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        nargs=2,
        default=(16, 96),
        metavar=("MIN", "MAX"),
        help="output tokens per request, uniform (default: 16 96)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        nargs=2,
        default=(8, 120),
        metavar=("MIN", "MAX"),
        help="prompt tokens per request, uniform (default: 8 120)",
    )
    parser.add_argument("--deadline", type=float, default=30.0, help="each request's deadline, s (default: 30)")
    parser.add_argument("--fault-interval", type=float, default=8.0, help="mean seconds between faults (default: 8)")
    parser.add_argument(
        "--restart-delay", type=float, default=2.0, help="the supervisor's first restart back-off, s (default: 2)"
    )
    parser.add_argument("--transfer-timeout", type=float, default=5.0, help="decode's KV pull deadline (default: 5)")
    parser.add_argument("--hold", type=float, default=15.0, help="prefill's pin deadline, s (default: 15)")
    parser.add_argument("--seed", type=int, default=0, help="faults and workload (default: 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _tiny_model(directory: Path) -> str:
    write_checkpoint(SMOKE, directory, "float32", 0, None)
    return str(directory)


async def _registered(etcd_url: str) -> list[WorkerEntry]:
    etcd = EtcdConnection(etcd_url)
    view = RegistryView(etcd)
    try:
        await view.start()
        return view.workers(model=MODEL)
    finally:
        await view.close()
        await etcd.close()


def _metrics(entry: WorkerEntry) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{entry.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values.setdefault(name.split("{")[0], float(value))
    return values


# ---- load ----------------------------------------------------------------------------------------
def _lane(args: argparse.Namespace, rng: random.Random, until: float, counter: itertools.count) -> Any:
    """One stream's requests until ``until``: random prompts and lengths from its own ``rng``."""

    def draw() -> BenchRequest:
        prompt = [rng.randrange(2, 200) for _ in range(rng.randint(*args.prompt_tokens))]
        return BenchRequest(next(counter), prompt, rng.randint(*args.max_tokens))

    return requests_until(until, draw)


# ---- faults --------------------------------------------------------------------------------------
def _running(cluster: LocalCluster, chaos: Chaos, role: Role) -> list[Child]:
    return [
        c
        for c in cluster.workers[role]
        if c.is_alive and c.process.pid not in chaos.stopped and c.name not in chaos.restarting
    ]


def _own(chaos: Chaos, coro: Any) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    chaos.tasks.add(task)
    task.add_done_callback(chaos.tasks.discard)


async def _pause(child: Child, seconds: float, chaos: Chaos) -> None:
    start = time.perf_counter()
    try:
        await asyncio.sleep(seconds)
    finally:
        os.kill(child.process.pid, signal.SIGCONT)
        chaos.stopped.discard(child.process.pid)
        chaos.windows.append(("pause", child.name, start, time.perf_counter()))


async def _restarted(child: Child, num_starts: int, chaos: Chaos) -> None:
    """Until the supervisor has the killed ``child`` serving again (a new process, listening)."""
    start = time.perf_counter()
    async with asyncio.timeout(RESTART_TIMEOUT_S):
        while child.num_starts == num_starts:
            await asyncio.sleep(0.1)
    chaos.restarting.discard(child.name)
    chaos.worker_restarts += 1
    chaos.windows.append(("kill", child.name, start, time.perf_counter()))


async def _inject(
    cluster: LocalCluster, etcd: EtcdProcess, args: argparse.Namespace, rng: random.Random, until: float, chaos: Chaos
) -> None:
    while True:
        await asyncio.sleep(rng.expovariate(1 / args.fault_interval))
        if time.perf_counter() >= until:
            return
        kind = rng.choice(("kill", "kill", "pause", "pause", "etcd"))
        if kind == "etcd":
            start = time.perf_counter()
            _log("restarting etcd")
            await etcd.stop()
            await etcd.start()  # the same ports and data
            chaos.etcd_restarts += 1
            chaos.windows.append(("etcd", "etcd", start, time.perf_counter()))
            continue
        role = rng.choice([r for r in Role if len(_running(cluster, chaos, r)) >= 2] or [None])
        if role is None:
            continue  # no role has a worker to spare now
        victim = rng.choice(_running(cluster, chaos, role))
        if kind == "kill":
            _log(f"SIGKILL {victim.name} (pid {victim.process.pid})")
            chaos.restarting.add(victim.name)
            os.kill(victim.process.pid, signal.SIGKILL)
            _own(chaos, _restarted(victim, victim.num_starts, chaos))
        else:
            seconds = rng.uniform(1.0, 2 * args.transfer_timeout)
            _log(f"SIGSTOP {victim.name} (pid {victim.process.pid}) for {seconds:.1f} s")
            chaos.stopped.add(victim.process.pid)
            os.kill(victim.process.pid, signal.SIGSTOP)
            _own(chaos, _pause(victim, seconds, chaos))


# ---- the run -------------------------------------------------------------------------------------
async def _idle_and_whole(etcd_url: str) -> dict[str, int]:
    """Each registered worker's KV blocks used or pinned, once all are 0 or IDLE_TIMEOUT_S passed."""
    deadline = time.perf_counter() + IDLE_TIMEOUT_S
    while True:
        leaked = {}
        for entry in await _registered(etcd_url):
            m = await asyncio.to_thread(_metrics, entry)
            leaked[entry.worker_id] = int(m["pdserve_kv_blocks_used"] + m["pdserve_held_requests"])
        if not any(leaked.values()) or time.perf_counter() > deadline:
            return leaked
        await asyncio.sleep(0.5)


def _p99(values: list[float]) -> float | None:
    p99 = nearest_rank(values, 0.99)
    return None if p99 is None else round(p99, 1)


def _report(
    args: argparse.Namespace,
    outcomes: list[RequestResult],
    chaos: Chaos,
    leaked: dict[str, int],
    live: dict[str, int],
    seconds: float,
) -> dict[str, Any]:
    failed = [o for o in outcomes if o.error not in (None, "HUNG")]
    causes = {"deadline": 0, "migrations": 0, "unexplained": 0}
    unexplained = []
    for o in failed:
        if o.error == "DEADLINE_EXCEEDED":
            causes["deadline"] += 1
        elif o.error == "UNAVAILABLE" and "max_migrations" in o.detail:
            causes["migrations"] += 1
        else:
            causes["unexplained"] += 1
            unexplained.append(f"{o.error}: {o.detail}")
    ok = [o for o in outcomes if o.error is None]
    migrations = {id(o): o.breakdown.get("migrations", 0) for o in outcomes}
    faults = {kind: sum(w[0] == kind for w in chaos.windows) for kind in ("kill", "pause", "etcd")}
    return {
        "duration_s": round(seconds, 1),
        "deployment": {
            "prefill": args.prefill,
            "decode": args.decode,
            "concurrency": args.concurrency,
            "deadline_s": args.deadline,
            "transfer_timeout_s": args.transfer_timeout,
            "hold_s": args.hold,
            "fault_interval_s": args.fault_interval,
            "seed": args.seed,
        },
        "sent": len(outcomes),
        "completed": len(ok),
        "migrated": sum(migrations[id(o)] > 0 for o in ok),
        "migrations": sum(migrations.values()),
        "failed": len(failed),
        "failed_by_cause": causes,
        "unexplained_failures": unexplained[:20],
        "hung": sum(o.error == "HUNG" for o in outcomes),
        "leaked_blocks": leaked,
        "faults": faults,
        "restarts": {"workers": chaos.worker_restarts, "etcd": chaos.etcd_restarts},
        "live_workers_at_end": live,
        "ttft_p99_ms": {
            "during_faults": _p99([o.ttft_ms for o in ok if o.ttft_ms is not None and chaos.during(o.sent_at)]),
            "outside_faults": _p99([o.ttft_ms for o in ok if o.ttft_ms is not None and not chaos.during(o.sent_at)]),
        },
    }


async def _run(args: argparse.Namespace, model: str, etcd: EtcdProcess) -> dict[str, Any]:
    # Restarts never given up on: the soak kills the same slot again and again.
    restart = RestartPolicy(max_restarts=10_000, min_backoff_s=args.restart_delay)
    spec = DeploySpec(
        args.prefill,
        args.decode,
        "always",
        model=model,
        model_name=MODEL,
        threads_per_worker=1,
        etcd=etcd.url,
        restart=restart,
        request_timeout_s=args.deadline,
        start_timeout_s=180,
        worker={"lease_ttl_s": 3.0, "hold_s": args.hold, "transfer_timeout_s": args.transfer_timeout},
    )
    rng = random.Random(args.seed)
    chaos = Chaos()
    async with Deployment(spec) as deployment:
        cluster = deployment.cluster
        assert cluster is not None
        try:
            async with inference_stub(deployment.address) as stub:
                began = time.perf_counter()
                until = began + args.duration
                _log(
                    f"load for {args.duration:g} s, {args.concurrency} streams, a fault every ~{args.fault_interval:g} s"
                )
                counter = itertools.count()
                lanes = [_lane(args, random.Random(rng.random()), until, counter) for _ in range(args.concurrency)]
                sampling = SamplingSpec(timeout_s=args.deadline, hang_grace_s=HANG_GRACE_S)
                outcomes, _ = await asyncio.gather(
                    run_lanes(stub, MODEL, lanes, sampling), _inject(cluster, etcd, args, rng, until, chaos)
                )
                seconds = time.perf_counter() - began
                # Every pause resumed, every restart done.
                for failure in await asyncio.gather(*chaos.tasks, return_exceptions=True):
                    if failure is not None:
                        _log(f"a resume or restart failed: {failure!r}")
            leaked = await _idle_and_whole(etcd.url)
            entries = await _registered(etcd.url)
            live = {role: sum(e.role == role for e in entries) for role in ("prefill", "decode")}
            return _report(args, outcomes, chaos, leaked, live, seconds)
        finally:
            for pid in chaos.stopped:
                os.kill(pid, signal.SIGCONT)


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as tmp:
        model = args.model or _tiny_model(Path(tmp) / "model")
        return asyncio.run(_with_etcd(args, model, Path(tmp) / "etcd"))


async def _with_etcd(args: argparse.Namespace, model: str, state_dir: Path) -> dict[str, Any]:
    etcd = EtcdProcess(state_dir)
    await etcd.start()
    try:
        return await _run(args, model, etcd)
    finally:
        await etcd.stop()


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    emit(run(args), args.json, width=22)


if __name__ == "__main__":
    main()
