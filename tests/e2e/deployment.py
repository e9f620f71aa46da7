"""A real deployment for end-to-end tests: ``LocalCluster`` (the code behind ``pdserve up``)
run on its own event-loop thread, so that synchronous tests can start, signal and stop it.
Every worker and the frontend are real processes; the registry is the test's real etcd."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
import msgspec

from pdserve.discovery.etcd import EtcdConnection
from pdserve.discovery.etcd_auth import EtcdAuth
from pdserve.discovery.registry import WorkerEntry
from pdserve.discovery.registry_view import RegistryView
from pdserve.frontend.config import Disaggregation, FrontendConfig, RouterConfig
from pdserve.launch.deployment_record import DeploymentRecord, read_record
from pdserve.launch.etcd_process import find_etcd
from pdserve.launch.local_cluster import Child, ClusterSpec, LocalCluster
from pdserve.launch.supervisor import RestartPolicy
from pdserve.rpc.tls import ClientTLS
from pdserve.v1 import inference_pb2, inference_pb2_grpc
from pdserve.worker.config import WorkerConfig


def long_context_copy(checkpoint: Path, directory: Path, max_position_embeddings: int) -> Path:
    """The checkpoint's files in ``directory`` with a longer context window in config.json."""
    for file in checkpoint.iterdir():
        (directory / file.name).symlink_to(file)
    config = json.loads((checkpoint / "config.json").read_text())
    config["max_position_embeddings"] = max_position_embeddings
    (directory / "config.json").unlink()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def bound_port(line: str) -> int:
    """The port in a server's "... on HOST:PORT" line.

    Servers in tests bind port 0 and report the port they got: a port picked free beforehand
    can be taken by another process (a worker's gRPC or NIXL listener) before it is bound.
    """
    found = re.search(r" on [^\s;]+:(\d+)", line)
    assert found, f"no listening address in {line!r}"
    return int(found.group(1))


def scrape(port: int | None) -> dict[str, float]:
    """The Prometheus series served on ``port``, by name, labels dropped (the first series of each name)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values.setdefault(name.split("{")[0], float(value))
    return values


def rank_children(parents: list[int], module: str = "pdserve.worker.group.rank_main") -> list[int]:
    """The pids of the serving ranks (tensor-parallel ones by default; ``module``:
    ``pdserve.worker.data_parallel`` for data-parallel ones) started by ``parents``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                cmdline = file.read()
            with open(f"/proc/{entry}/stat") as file:
                parent = int(file.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if module.encode() in cmdline and parent in parents:
            found.append(int(entry))
    return found


class Deployment:
    def __init__(
        self,
        model: str,
        etcd: str,
        *,
        prefill: int,
        decode: int,
        model_name: str,
        disaggregation: Disaggregation,
        restart: RestartPolicy = RestartPolicy(max_restarts=0),
        worker_fields: dict[str, Any] | None = None,
        prefill_fields: dict[str, Any] | None = None,
        decode_fields: dict[str, Any] | None = None,
        frontend_fields: dict[str, Any] | None = None,
        client_tls: ClientTLS | None = None,
        etcd_auth: EtcdAuth = EtcdAuth(),
        api_keys: tuple[str, ...] = (),
    ) -> None:
        """``restart``: by default a child that dies stays dead (tests kill workers to see the
        rest cope); pass a policy to have them restarted as ``pdserve up`` does.
        ``worker_fields`` (both roles), ``prefill_fields``, ``decode_fields`` and
        ``frontend_fields``: ``WorkerConfig`` and ``FrontendConfig`` fields that differ from the
        defaults here (TLS, etcd credentials, engine options). ``client_tls`` is how the test's
        client reaches the public API, and ``etcd_auth`` how the test reads the registry."""
        self.etcd = etcd
        self.etcd_auth = etcd_auth
        self.model_name = model_name
        worker = WorkerConfig(
            role="prefill",
            model=model,
            etcd=etcd,
            model_name=model_name,
            lease_ttl_s=3.0,
            num_threads=1,
            **(worker_fields or {}),
        )
        frontend = FrontendConfig(
            etcd=etcd,
            port=0,
            http_port=0,
            api_keys=list(api_keys),
            router=RouterConfig(disaggregation=disaggregation),
            **(frontend_fields or {}),
        )
        self.cluster = LocalCluster(
            ClusterSpec(
                prefill=msgspec.structs.replace(worker, **(prefill_fields or {})),
                decode=msgspec.structs.replace(worker, role="decode", **(decode_fields or {})),
                frontend=frontend,
                etcd=etcd,
                start_timeout_s=120,
                stop_timeout_s=30,
                restart=restart,
            )
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.run(self.cluster.start(prefill, decode), timeout=240)
        assert self.cluster.frontend is not None
        self.port = bound_port(f" on {self.cluster.frontend.address}")
        self.http_url = self.cluster.frontend.http_url  # the OpenAI API's base URL, ".../v1"
        if client_tls is None:
            self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        else:
            self.channel = grpc.secure_channel(
                f"127.0.0.1:{self.port}", client_tls.grpc_credentials(), options=client_tls.grpc_options()
            )
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)

    def run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.channel.close()
        self.run(self.cluster.stop(), timeout=120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    # ---- workers ---------------------------------------------------------------------------
    def worker(self, role: str, index: int = 0) -> Child:
        return self.cluster.workers[role][index]

    def kill(self, child: Child, sig: int = signal.SIGKILL) -> None:
        os.kill(child.process.pid, sig)

    def restart(self, child: Child) -> Child:
        """Start a new worker in dead ``child``'s place, with the same configuration; returns it
        (as ``pdserve up``'s supervisor would, for a deployment made with no restarts)."""
        role = child.name.rsplit("-", 1)[0]
        self.run(child.process.wait(), timeout=10)
        pool = self.cluster.workers[role]
        if child in pool:  # the supervisor drops a child it gave up on (no restarts: at once)
            pool.remove(child)
        counts = {r: len(self.cluster.workers[r]) for r in ("prefill", "decode")}
        counts[role] += 1
        self.run(self.cluster.scale(counts["prefill"], counts["decode"]), timeout=180)
        return pool[-1]

    @staticmethod
    def worker_metrics(entry: WorkerEntry) -> dict[str, float]:
        """The worker's Prometheus gauges and counters, by name (labels dropped: one worker each)."""
        return scrape(entry.metrics_port)

    def wait_whole(self, timeout: float) -> None:
        """Until every live registered worker, read from its /metrics, is idle with no KV block used
        or pinned (a dead one whose lease has not run out yet answers no scrape, and is skipped)."""

        def state() -> dict[str, tuple[float, float, float]]:
            found = {}
            for entry in self.registered():
                try:
                    m = self.worker_metrics(entry)
                except OSError:
                    continue
                found[entry.worker_id] = (
                    m["pdserve_kv_blocks_used"],
                    m["pdserve_held_requests"],
                    m["pdserve_running_requests"],
                )
            return found

        deadline = time.monotonic() + timeout
        while True:
            now = state()
            if not any(any(values) for values in now.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"workers not whole {timeout}s on (blocks used, held, running): {now}")
            time.sleep(0.2)

    def registered(self) -> list[WorkerEntry]:
        """The workers etcd lists for this deployment's model, read now."""

        async def read() -> list[WorkerEntry]:
            etcd = EtcdConnection(self.etcd, auth=self.etcd_auth)
            view = RegistryView(etcd)
            try:
                await view.start()
                return view.workers(model=self.model_name)
            finally:
                await view.close()
                await etcd.close()

        return self.run(read())

    def wait_registered(self, predicate: Callable[[list[WorkerEntry]], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.registered()):
                return
            time.sleep(0.2)
        loads = {w.worker_id: w.load for w in self.registered()}
        raise AssertionError(f"timed out after {timeout}s waiting for {what}: {loads}")

    # ---- requests --------------------------------------------------------------------------
    def generate(self, prompt: list[int] | str, timeout: float = 120, **sampling: Any) -> dict[str, Any]:
        """One streamed request: its tokens, the text its messages streamed, and its final message."""
        request = inference_pb2.GenerateRequest(
            model=self.model_name, sampling=inference_pb2.SamplingOptions(**sampling)
        )
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        return collect(self.stub.Generate(request, timeout=timeout))


def collect(responses: Iterable[inference_pb2.GenerateResponse]) -> dict[str, Any]:
    """A stream's tokens, the text its messages streamed, their logprobs, and its final message."""
    tokens: list[int] = []
    text = ""
    logprobs: list[inference_pb2.TokenLogprobs] = []
    final = None
    for response in responses:
        tokens += response.token_ids
        text += response.text
        logprobs += response.logprobs
        if response.HasField("final"):
            final = response.final
    assert final is not None, "the stream ended without a final message"
    return {"token_ids": tokens, "text": text, "logprobs": logprobs, "final": final}


class Frontend:
    """One more frontend process over the same registry (e.g. with other routing or limits)."""

    def __init__(self, etcd: str, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "frontend", "--etcd", etcd, "--port", "0", "--http-port", "0", *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if "listening on" in line:
                self.port = bound_port(line)
                found = re.search(r"https?://\S+", line)
                self.http_url = found.group(0) if found else ""  # the OpenAI API's base URL
                break
        else:
            raise AssertionError(f"frontend exited with {self.process.wait()}")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.process.terminate()
        self.process.wait(30)


class UpProcess:
    """``pdserve up ARGS`` as a user runs it, its output read to the end on a thread (a pipe
    nobody reads would block ``up`` once full) and kept, so that a failure can show it all."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._is_up = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            if "pdserve is up" in line:
                self._is_up.set()
        self._is_up.set()  # exited before coming up: wait_up reports it

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_up(self, timeout: float = 120) -> tuple[str, int]:
        """The "pdserve is up" line and the port it names; fails with the output otherwise."""
        assert self._is_up.wait(timeout) and self.process.poll() is None, f"pdserve up did not come up:\n{self.output}"
        line = next(line for line in self.lines if "pdserve is up" in line)
        return line, bound_port(line)

    def close(self) -> None:
        """Kill ``up`` if it still runs (a test that passed has stopped it already)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._reader.join(10)


def recorded_deployment() -> DeploymentRecord:
    """The record of the ``pdserve up`` this test runs (in the test's ``$PDSERVE_STATE_DIR``)."""
    record = read_record(Path(os.environ["PDSERVE_STATE_DIR"]))
    assert record is not None, f"no pdserve up recorded in {os.environ['PDSERVE_STATE_DIR']}"
    return record


def etcdctl(*args: str, certificates: bool = True) -> subprocess.CompletedProcess[str]:
    """etcdctl on the registry of the ``pdserve up`` this test runs: presenting the tools'
    certificate, as the ``pdserve`` commands beside it do, or (``certificates=False``) none."""
    record = recorded_deployment()
    tls = []
    if certificates and record.etcd_tls is not None:
        tls = [f"--cacert={record.etcd_tls.ca}", f"--cert={record.etcd_tls.cert}", f"--key={record.etcd_tls.key}"]
    elif record.etcd.startswith("https://"):
        tls = ["--insecure-skip-tls-verify"]  # no trust of the server asked: the client is what is refused
    return subprocess.run(
        [str(find_etcd().with_name("etcdctl")), f"--endpoints={record.etcd}", "--dial-timeout=3s", *tls, *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
