"""A real ``pdserve frontend`` process over a real etcd, serving one scripted decode worker
(``FakeWorker``, on an event loop of its own thread) whose model has a real tokenizer: what the
tests of hostile clients aim at. Its output (logs included) is kept, so a test can check that
nothing in it is a traceback.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
from pathlib import Path

import grpc

from pdserve.v1 import inference_pb2_grpc
from tests.e2e.deployment import bound_port
from tests.frontend.fake_worker import FakeWorker, Script
from tests.utils.tiny_tokenizer import write_tiny_tokenizer


class HostileTarget:
    """The frontend (``args``: its extra options) and its worker; ``close`` stops both."""

    def __init__(self, etcd_url: str, model: str, tokenizer_dir: Path, script: Script, *args: str) -> None:
        write_tiny_tokenizer(tokenizer_dir)
        self.model = model
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-worker", daemon=True)
        self._thread.start()
        self.worker = FakeWorker(f"decode-{model.rsplit('-', 1)[-1]}", "decode", script)
        self._on_loop(self.worker.start(etcd_url, model, str(tokenizer_dir)))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "frontend", "--etcd", etcd_url, "--port", "0", "--http-port", "0"]
            + ["--disaggregation", "off", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            if "listening on" in line:
                self.port = bound_port(line)
                found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
                assert found, line
                self.http_port = int(found.group(1))
                self.http_url = f"http://127.0.0.1:{self.http_port}/v1"
                break
        else:
            raise AssertionError(f"frontend exited with {self.process.wait()}:\n{self.output}")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def _on_loop(self, coroutine) -> object:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(30)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def close(self) -> None:
        self.channel.close()
        self.process.terminate()
        self.process.wait(30)
        self._reader.join(5)
        self._on_loop(self.worker.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
