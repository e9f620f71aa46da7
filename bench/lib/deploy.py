"""Bring up a pdserve deployment for a bench, from one ``DeploySpec``: in this process's event
loop (``LocalCluster``, the code behind ``pdserve up``) or, with ``process``, as a
``pdserve up`` child process, the way a user runs it.

Contract: ``async with Deployment(spec) as deployment`` returns once the frontend lists the
served model with every worker of both pools registered (``model``: ListModels' entry), or
raises ``DeployFailed`` (saying why: a child that died, the log's tail, a deadline) after
stopping what it started. On exit everything it started is stopped: the cluster drains and
stops its children; ``pdserve up`` gets SIGINT (as Ctrl-C sends it) and, past the stop
deadline, its process group SIGKILL. ``start`` and ``stop`` hold nothing of an event loop, so
a synchronous caller may run each under its own ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from bench.lib.load import list_models
from pdserve.discovery.registry import Role
from pdserve.frontend.config import FrontendConfig, RouterConfig
from pdserve.launch.local_cluster import ChildFailed, ClusterSpec, LocalCluster
from pdserve.launch.supervisor import RestartPolicy
from pdserve.model.default_model import resolve_model
from pdserve.types.engine_config import EngineConfig
from pdserve.worker.config import WorkerConfig

_UP_LINE = "pdserve is up"
_STOP_TIMEOUT_S = 120.0


class DeployFailed(RuntimeError):
    """The deployment did not come up; the message says why."""


@dataclass(frozen=True)
class DeploySpec:
    """Attributes:
    num_prefill / num_decode: each pool's workers.
    disaggregation: the frontend's mode (always, conditional, off).
    model: a model directory or GGUF file (None: pdserve's default model).
    model_name: the served name ("": the model's own).
    threads_per_worker: torch threads of each worker (None: ``pdserve up``'s share, or torch's default).
    etcd: a running etcd's URL (None: the deployment's own registry).
    http: serve the OpenAI API too, on a free port.
    process: run ``pdserve up`` as a child process instead of the cluster in this process.
    In this process only: engine, worker (further ``WorkerConfig`` fields), restart,
    request_timeout_s (the frontend's; None: its default). As a process only: up_args (further
    ``pdserve up`` options), log (its output; None: a temporary file).
    start_timeout_s: how long the whole deployment may take to come up.
    """

    num_prefill: int
    num_decode: int
    disaggregation: str = "always"
    model: str | None = None
    model_name: str = ""
    threads_per_worker: int | None = None
    etcd: str | None = None
    http: bool = False
    process: bool = False
    engine: EngineConfig | None = None
    worker: dict[str, Any] = field(default_factory=dict)
    restart: RestartPolicy | None = None
    request_timeout_s: float | None = None
    up_args: tuple[str, ...] = ()
    log: Path | None = None
    start_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(f"need num_prefill >= 0 and num_decode >= 1, got {self.num_prefill} and {self.num_decode}")
        local = {
            "engine": self.engine,
            "worker": self.worker,
            "restart": self.restart,
            "request_timeout_s": self.request_timeout_s,
        }
        remote = {"up_args": self.up_args, "log": self.log}
        for name, value in (local if self.process else remote).items():
            if value:
                raise ValueError(f"{name} is for a deployment {'in this process' if self.process else 'process'} only")


class Deployment:
    """Attributes, once started:
    address: the frontend's gRPC HOST:PORT.
    http_url: its OpenAI API's base URL (``http://HOST:PORT``, no ``/v1``), or None.
    etcd_url: the registry's URL.
    model: the frontend's ListModels entry of the served model (``list_models``' dict).
    cluster: the ``LocalCluster`` (in this process), else None.
    process: the ``pdserve up`` child (as a process), else None.
    """

    def __init__(self, spec: DeploySpec) -> None:
        self.spec = spec
        self.address = ""
        self.http_url: str | None = None
        self.etcd_url = ""
        self.model: dict[str, Any] = {}
        self.cluster: LocalCluster | None = None
        self.process: subprocess.Popen | None = None
        self._served_name = spec.model_name
        self._log: Path | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    async def __aenter__(self) -> Deployment:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        try:
            if self.spec.process:
                await self._start_up(deadline)
            else:
                await self._start_cluster()
            self.model = await self._registered(deadline)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            await cluster.stop()
        if self.process is not None:
            process, self.process = self.process, None
            await asyncio.to_thread(_stop_up, process)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def worker_pids(self, role: Role) -> list[int]:
        """The pids of the ``role`` workers running now, oldest first."""
        if self.cluster is not None:
            return [c.process.pid for c in self.cluster.workers[role] if c.is_alive]
        assert self.process is not None, "not started"
        return _children_with_arg(self.process.pid, str(role).encode())

    async def _start_cluster(self) -> None:
        s = self.spec
        name = s.model_name or None
        prefill = WorkerConfig(
            role=Role.PREFILL,
            model=resolve_model(s.model),
            etcd="",
            model_name=name,
            num_threads=s.threads_per_worker,
            engine=s.engine or EngineConfig(),
            **s.worker,
        )
        timeout = {} if s.request_timeout_s is None else {"request_timeout_s": s.request_timeout_s}
        frontend = FrontendConfig(
            etcd="",
            port=0,
            http_port=0 if s.http else None,
            router=RouterConfig(disaggregation=s.disaggregation),
            **timeout,
        )
        # The cluster gives every child its registry's URL as ``etcd``.
        spec = ClusterSpec(
            prefill=prefill,
            decode=msgspec.structs.replace(prefill, role=Role.DECODE),
            frontend=frontend,
            etcd=s.etcd,
            start_timeout_s=s.start_timeout_s,
            restart=s.restart or RestartPolicy(),
        )
        self._served_name = prefill.served_model_name
        self.cluster = LocalCluster(spec)
        try:
            await self.cluster.start(s.num_prefill, s.num_decode)
        except ChildFailed as exc:
            raise DeployFailed(str(exc)) from None
        assert self.cluster.frontend is not None and self.cluster.etcd_url is not None
        self.address, self.etcd_url = self.cluster.frontend.address, self.cluster.etcd_url
        http = self.cluster.frontend.http_url
        self.http_url = http.removesuffix("/v1") if http else None

    async def _start_up(self, deadline: float) -> None:
        s = self.spec
        command = [
            sys.executable,
            "-m",
            "pdserve",
            "up",
            "--prefill",
            str(s.num_prefill),
            "--decode",
            str(s.num_decode),
            "--disaggregation",
            s.disaggregation,
            "--port",
            "0",
            "--http-port",
            "0" if s.http else "-1",
        ]
        for flag, value in (
            ("--model", s.model),
            ("--model-name", s.model_name),
            ("--etcd", s.etcd),
            ("--threads-per-worker", s.threads_per_worker),
        ):
            if value:
                command += [flag, str(value)]
        command += s.up_args
        if s.log is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-bench-up-")
        self._log = s.log or Path(self._tmp.name) / "up.log"  # type: ignore[union-attr]
        offset = self._log.stat().st_size if self._log.exists() else 0  # an earlier run's output comes first
        with self._log.open("ab") as out:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        while True:
            with self._log.open("rb") as out:
                out.seek(offset)
                line = next((x for x in out.read().decode(errors="replace").splitlines() if _UP_LINE in x), None)
            if line is not None:
                break
            if self.process.poll() is not None:
                raise DeployFailed(f"pdserve up exited with {self.process.returncode}:\n{self._tail()}")
            if time.monotonic() > deadline:
                raise DeployFailed(f"pdserve up did not come up in {s.start_timeout_s:g} s:\n{self._tail()}")
            await asyncio.sleep(0.5)
        self.address = re.search(r"Inference on (\S+?)[,;]", line).group(1)  # type: ignore[union-attr]
        self.etcd_url = re.search(r"registry (\S+)", line).group(1)  # type: ignore[union-attr]
        http = re.search(r"OpenAI API on (\S+?);", line)
        self.http_url = http.group(1).removesuffix("/v1") if http else None

    async def _registered(self, deadline: float) -> dict[str, Any]:
        """Until the frontend lists the model with every worker of both pools registered."""
        s = self.spec
        seen: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            try:
                seen = await list_models(self.address)
            except Exception as exc:  # noqa: BLE001 - the frontend may not answer yet
                seen = [{"error": repr(exc)}]
            for m in seen:
                if (m.get("name") == self._served_name or not self._served_name) and (
                    m.get("prefill_workers"),
                    m.get("decode_workers"),
                ) == (s.num_prefill, s.num_decode):
                    return m
            if self.process is not None and self.process.poll() is not None:
                raise DeployFailed(f"pdserve up exited with {self.process.returncode}:\n{self._tail()}")
            await asyncio.sleep(0.2)
        raise DeployFailed(
            f"the frontend did not list {self._served_name or 'the model'} with {s.num_prefill}P+"
            f"{s.num_decode}D within {s.start_timeout_s:g} s: {seen}"
        )

    def _tail(self) -> str:
        return self._log.read_text(errors="replace")[-3000:] if self._log is not None else ""


def _stop_up(process: subprocess.Popen) -> None:
    """SIGINT to ``pdserve up``'s process group (it drains its children), SIGKILL past the deadline."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _children_with_arg(parent: int, arg: bytes) -> list[int]:
    """The pids of ``parent``'s child processes with ``arg`` among their arguments."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().split()[3]) == parent:
                if arg in (entry / "cmdline").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return sorted(pids)
