"""A real prefill worker's probes as the kubelet sees them: /readyz says 503 until the worker is
warm and registered in etcd, 200 then, 503 again as it drains; /livez stays 200 while it idles
past its deadline."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from pdserve.v1 import inference_pb2, worker_pb2, worker_pb2_grpc

LIVENESS_DEADLINE_S = 2.0
HOLD_S = 8.0  # the pinned prefill that keeps the drain going


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode().strip()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode().strip()
    except OSError as error:  # not listening (any more): the poll names it among what it saw
        return 0, repr(error)


def _poll(port: int, path: str, want: tuple[int, str], timeout_s: float) -> list[tuple[int, str]]:
    """Every distinct answer until ``want``; fails naming them if it does not come in time."""
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout_s
    while True:
        answer = _get(port, path)
        if not seen or seen[-1] != answer:
            seen.append(answer)
        if answer == want:
            return seen
        assert time.monotonic() < deadline, f"{path}: {want} never came; saw {seen}"
        time.sleep(0.05)


class _Worker:
    """``pdserve prefill`` as a process; its stdout lines kept as they come."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "prefill", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def wait_line(self, pattern: str, timeout_s: float = 120) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.lines:
                if found := re.search(pattern, line):
                    return found
            assert self.process.poll() is None, "the worker exited:\n" + "".join(self.lines)
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}:\n" + "".join(self.lines))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.mark.slow
def test_readyz_follows_registration_and_drain_and_livez_holds_while_idle(checkpoints, etcd_server):
    path, _ = checkpoints("llama")
    etcd_server.stop()  # registration has to wait for it: /readyz must say so
    worker = _Worker(
        "--model", str(path), "--model-name", "health-test", "--etcd", etcd_server.url,
        "--port", "0", "--metrics-port", "0", "--hold", f"{HOLD_S:g}", "--drain-timeout", "30",
        "--liveness-deadline", f"{LIVENESS_DEADLINE_S:g}",
    )  # fmt: skip
    try:
        port = int(worker.wait_line(r"probes at http://[^:]+:(\d+)/readyz").group(1))
        seen = _poll(port, "/readyz", (503, "not registered"), timeout_s=60)
        assert all(status == 503 for status, _ in seen), seen
        time.sleep(0.5)
        assert _get(port, "/readyz") == (503, "not registered")  # no etcd, no readiness
        etcd_server.start()
        seen = _poll(port, "/readyz", (200, "ok"), timeout_s=30)
        assert all(status == 503 for status, _ in seen[:-1]), seen

        time.sleep(1.5 * LIVENESS_DEADLINE_S)  # an idle engine still comes round its loop
        assert _get(port, "/livez") == (200, "ok")

        endpoint = worker.wait_line(r"listening on (\S+)").group(1)
        with grpc.insecure_channel(endpoint) as channel:
            worker_pb2_grpc.WorkerStub(channel).Prefill(
                worker_pb2.PrefillRequest(
                    request_id="pinned",
                    prompt_token_ids=[5, 6, 7, 8],
                    sampling=inference_pb2.SamplingOptions(max_tokens=4, temperature=0, ignore_eos=True),
                ),
                timeout=30,
            )
        worker.process.send_signal(signal.SIGTERM)  # the drain waits for the pin to expire
        _poll(port, "/readyz", (503, "draining"), timeout_s=HOLD_S / 2)
        assert _get(port, "/livez") == (200, "ok")
        assert worker.process.wait(HOLD_S + 30) == 0
    finally:
        worker.close()
