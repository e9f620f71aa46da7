"""A decode worker killed under load, as a user meets it: `pdserve up` (1 prefill + 2 decode,
--disaggregation always) on the default model (or --model), --streams concurrent greedy streams
of --max-tokens tokens, and SIGKILL to one decode worker --kill-after seconds into the run.

The same streams run once undisturbed first (the reference, and the warm-up). Reported: how
many of the disturbed streams completed, how many with exactly the reference's tokens, the
migrations their breakdowns report, every failure's status, and how long after the kill the
registry listed two decode workers again (`pdserve up` restarts the killed one).

    python bench/migration.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from pdserve.v1 import inference_pb2, inference_pb2_grpc

TOPICS = ["the sea", "a old clock", "the first snow", "a lighthouse keeper", "bread", "a lost key", "the moon",
          "a city at night", "a long train journey", "an orchard", "a chess game", "the last bookshop"]  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench/migration.py", description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", default=None, help="model path (default: pdserve's default model)")
    parser.add_argument("--streams", type=int, default=12, help="concurrent greedy streams (default: 12)")
    parser.add_argument("--max-tokens", type=int, default=300, help="tokens each stream generates (default: 300)")
    parser.add_argument("--kill-after", type=float, default=6.0, help="seconds into the run of the kill (default: 6)")
    parser.add_argument("--deadline", type=float, default=300.0, help="each request's deadline, s (default: 300)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


class Up:
    """`pdserve up` as a child process: its gRPC port, its registry URL, its worker processes."""

    def __init__(self, model: str | None) -> None:
        command = [sys.executable, "-m", "pdserve", "up", "--prefill", "1", "--decode", "2",
                   "--disaggregation", "always", "--port", "0", "--http-port", "-1"]  # fmt: skip
        if model:
            command += ["--model", model]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        up = threading.Event()
        threading.Thread(target=self._read, args=(up,), daemon=True).start()
        if not up.wait(600) or self.process.poll() is not None:
            self.stop()
            raise RuntimeError("pdserve up did not come up:\n" + "".join(self.lines[-40:]))
        line = next(line for line in self.lines if "pdserve is up" in line)
        self.port = int(re.search(r" on [^\s;]+:(\d+)", line).group(1))
        self.etcd = re.search(r"registry (\S+)", line).group(1)

    def _read(self, up: threading.Event) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            if "pdserve is up" in line:
                up.set()
        up.set()

    def decode_workers(self) -> list[int]:
        """The pids of the decode worker processes `up` runs now."""
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and int((entry / "stat").read_text().split()[3]) == self.process.pid:
                    argv = (entry / "cmdline").read_bytes().split(b"\0")
                    if b"decode" in argv:
                        pids.append(int(entry.name))
            except (OSError, ValueError):
                continue
        return sorted(pids)

    def registered_decode_workers(self) -> int:
        listed = subprocess.run([sys.executable, "-m", "pdserve", "workers", "--etcd", self.etcd, "--json"],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        return sum(w["role"] == "decode" for w in json.loads(listed.stdout)) if listed.returncode == 0 else 0

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def run_streams(stub, prompts: list[str], max_tokens: int, deadline_s: float) -> list[dict[str, Any]]:
    def one(prompt: str) -> dict[str, Any]:
        request = inference_pb2.GenerateRequest(
            text=prompt, sampling=inference_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        )
        tokens: list[int] = []
        try:
            for response in stub.Generate(request, timeout=deadline_s):
                tokens += response.token_ids
                if response.HasField("final"):
                    history = [
                        (m.from_worker, m.to_worker, m.tokens_streamed)
                        for m in response.final.breakdown.migration_history
                    ]
                    return {"status": "OK", "tokens": tokens, "migrations": history}
            return {"status": "NO_FINAL", "tokens": tokens, "migrations": []}
        except grpc.RpcError as exc:
            return {"status": exc.code().name, "details": exc.details(), "tokens": tokens, "migrations": []}

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def main() -> None:
    args = _parser().parse_args()
    prompts = [f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}." for i in range(args.streams)]
    up = Up(args.model)
    try:
        stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{up.port}"))
        started = time.monotonic()
        reference = run_streams(stub, prompts, args.max_tokens, args.deadline)
        undisturbed_s = time.monotonic() - started
        victims = up.decode_workers()
        killed: dict[str, float] = {}

        def kill() -> None:
            os.kill(victims[0], signal.SIGKILL)
            killed["at"] = time.monotonic()

        timer = threading.Timer(args.kill_after, kill)
        started = time.monotonic()
        timer.start()
        disturbed = run_streams(stub, prompts, args.max_tokens, args.deadline)
        timer.join()
        disturbed_s = time.monotonic() - started
        while up.registered_decode_workers() < 2 and time.monotonic() - killed["at"] < 120:
            time.sleep(0.5)
        back_s = time.monotonic() - killed["at"] if up.registered_decode_workers() >= 2 else None
    finally:
        up.stop()
    report = {
        "streams": args.streams, "max_tokens": args.max_tokens, "kill_after_s": args.kill_after,
        "reference_completed": sum(r["status"] == "OK" for r in reference),
        "completed": sum(r["status"] == "OK" for r in disturbed),
        "identical_to_reference": sum(d["status"] == "OK" and d["tokens"] == r["tokens"] for d, r in zip(disturbed, reference)),
        "migrated": sum(bool(d["migrations"]) for d in disturbed),
        "migrations": [d["migrations"] for d in disturbed if d["migrations"]],
        "failures": [{k: d[k] for k in ("status", "details") if k in d} for d in disturbed if d["status"] != "OK"],
        "two_decode_workers_again_after_s": None if back_s is None else round(back_s, 1),
        "undisturbed_run_s": round(undisturbed_s, 1), "disturbed_run_s": round(disturbed_s, 1),
    }  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
