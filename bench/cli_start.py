"""How soon ``pdserve generate --target`` sends its request: process start to the request's
arrival at a gRPC server.

A tiny ``pdserve.v1.Inference`` server runs in this process and notes when each ``Generate``
call arrives, then answers with one final message. Each round starts ``python -m pdserve
generate --target ... --token-ids 1,2,3 --json`` and times, on this process's clock, from just
before the child is spawned to the request's arrival (interpreter start, imports, argument
parsing, channel set-up and the first HTTP/2 exchange), and to the child's exit, with the CPU seconds the child used in all (user + system: what a
busy machine stretches least). A bare ``python -c pass`` is timed the same way, as the floor
no command can beat. Medians are reported, with the CPU model and its AVX flags.

    python -m bench.cli_start                  # a table
    python -m bench.cli_start --json --rounds 15
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures
from collections.abc import Iterator
from typing import Any

import grpc

from bench.lib.machine import cpu_model_and_flags
from bench.lib.report import emit
from pdserve.v1 import inference_pb2, inference_pb2_grpc


class _Recorder(inference_pb2_grpc.InferenceServicer):
    """Notes each Generate call's arrival time and answers with one final message."""

    def __init__(self) -> None:
        self.arrivals: list[float] = []
        self.arrived = threading.Event()

    def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[inference_pb2.GenerateResponse]:
        self.arrivals.append(time.perf_counter())
        self.arrived.set()
        yield inference_pb2.GenerateResponse(
            token_ids=[7], text="x", final=inference_pb2.Final(finish_reason="length", text="x")
        )


def _round(recorder: _Recorder, target: str) -> dict[str, float]:
    recorder.arrived.clear()
    command = [sys.executable, "-m", "pdserve", "generate", "--target", target, "--token-ids", "1,2,3", "--json"]
    before = _children_cpu_s()
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    exited = time.perf_counter()
    if done.returncode != 0 or not recorder.arrived.is_set():
        raise RuntimeError(f"pdserve generate failed ({done.returncode}): {done.stderr}")
    return {
        "to_request_s": recorder.arrivals[-1] - start,
        "to_exit_s": exited - start,
        "cpu_s": _children_cpu_s() - before,
    }


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _bare_python() -> tuple[float, float]:
    """Wall and CPU seconds of ``python -c pass``."""
    before = _children_cpu_s()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.perf_counter() - start, _children_cpu_s() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    recorder = _Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    inference_pb2_grpc.add_InferenceServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        rounds = []
        bare = []
        for _ in range(args.rounds):
            rounds.append(_round(recorder, f"127.0.0.1:{port}"))
            bare.append(_bare_python())
    finally:
        server.stop(grace=None)
    to_request = [r["to_request_s"] for r in rounds]
    model, flags = cpu_model_and_flags()
    result = {
        "median_to_request_s": statistics.median(to_request),
        "min_to_request_s": min(to_request),
        "max_to_request_s": max(to_request),
        "median_to_exit_s": statistics.median(r["to_exit_s"] for r in rounds),
        "median_cpu_s": statistics.median(r["cpu_s"] for r in rounds),
        "median_bare_python_s": statistics.median(wall for wall, _ in bare),
        "median_bare_python_cpu_s": statistics.median(cpu for _, cpu in bare),
        "rounds": args.rounds,
        "cpu_model": model,
        "cpu_flags": flags,
        "python": platform.python_version(),
    }
    emit(result, args.json, _table)


def _table(result: dict[str, Any]) -> None:
    print(
        f"process start -> request at the server: median {result['median_to_request_s'] * 1e3:.0f} ms "
        f"(min {result['min_to_request_s'] * 1e3:.0f}, max {result['max_to_request_s'] * 1e3:.0f}) "
        f"over {result['rounds']} rounds"
    )
    print(
        f"process start -> exit: median {result['median_to_exit_s'] * 1e3:.0f} ms, "
        f"{result['median_cpu_s'] * 1e3:.0f} ms of CPU; bare `python -c pass`: median "
        f"{result['median_bare_python_s'] * 1e3:.0f} ms, {result['median_bare_python_cpu_s'] * 1e3:.0f} ms of CPU"
    )
    print(f"CPU: {result['cpu_model']}; {' '.join(f for f in result['cpu_flags'] if f.startswith('avx'))}")


if __name__ == "__main__":
    main()
