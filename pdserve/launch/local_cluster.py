"""A whole pdserve deployment on one machine, as child processes (``pdserve up``).

``LocalCluster`` starts the registry (the given etcd, or an ``EmbeddedEtcd`` in this process),
the frontend, and the prefill and decode workers, each a ``python -m pdserve ...`` child with
its own engine and NIXL agent. A child gets its whole configuration, a ``WorkerConfig`` or
``FrontendConfig`` written as JSON, with ``--config FILE``, so a new option reaches it without
an edit here. A child is ready when it prints its "listening on" line; one that exits or stays
silent past the start-up deadline fails the start with its last output. ``scale`` adds
workers or drains the newest ones (SIGTERM); ``stop`` drains every child and kills any still
alive after the grace period. Nothing outlives the cluster, its configuration files included.

With the cluster's certificate set (the frontend configuration's ``cluster_tls``) the embedded
registry serves mTLS too, and every child reaches it presenting its own cluster certificate.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from pdserve.discovery.embedded_etcd import EmbeddedEtcd
from pdserve.discovery.etcd_auth import EtcdAuth
from pdserve.frontend.config import FrontendConfig
from pdserve.discovery.registry import Role
from pdserve.lifecycle import DUMP_SIGNAL, PARENT_PID_ENV
from pdserve.worker.config import WorkerConfig

logger = logging.getLogger(__name__)

_READY = "listening on "
# How long a child that did not stop gets to print its stacks before it is killed.
_DUMP_WAIT_S = 2.0


class ChildFailed(RuntimeError):
    """A child process exited or never became ready."""


@dataclass
class Child:
    name: str
    process: asyncio.subprocess.Process
    address: str = ""  # what it printed after "listening on"
    output: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=20))
    reader: asyncio.Task[None] | None = None


@dataclass(frozen=True)
class ClusterSpec:
    """Attributes:
    prefill / decode: the configuration of each worker of the pool.
    frontend: the frontend's configuration.
    etcd: an etcd URL, or None for the embedded registry. The registry is the cluster's: each
        child gets its URL as its configuration's ``etcd``, whatever that held.
    """

    prefill: WorkerConfig
    decode: WorkerConfig
    frontend: FrontendConfig
    etcd: str | None = None
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if (self.prefill.role, self.decode.role) != (Role.PREFILL, Role.DECODE):
            raise ValueError(f"the prefill and decode configurations have the roles {self.prefill.role!r} "
                             f"and {self.decode.role!r}")  # fmt: skip


class LocalCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.etcd_url: str | None = spec.etcd
        # How this process reaches the registry (as the frontend does).
        self.etcd_auth: EtcdAuth = spec.frontend.etcd_auth
        self._embedded: EmbeddedEtcd | None = None
        self.frontend: Child | None = None
        self.workers: dict[Role, list[Child]] = {role: [] for role in Role}
        self._count = 0
        self._config_dir: Path | None = None

    async def start(self, num_prefill: int, num_decode: int) -> None:
        """Start the registry, the workers and the frontend; all ready, or ChildFailed."""
        try:
            if self.etcd_url is None:
                self._embedded = EmbeddedEtcd()
                cluster_tls = self.spec.frontend.cluster_tls
                self.etcd_url = await self._embedded.start(tls=None if cluster_tls is None else cluster_tls.server)
                if cluster_tls is not None:
                    self.etcd_auth = EtcdAuth(tls=cluster_tls.client)
            self._write_configs(self.etcd_url)
            await self.scale(num_prefill, num_decode)
            self.frontend = await self._spawn("frontend", ["frontend", "--config", str(self._config_file("frontend"))])
        except BaseException:
            await self.stop()
            raise

    async def scale(self, num_prefill: int, num_decode: int) -> None:
        """Start workers up to, or drain the newest down to, the given counts."""
        starts = []
        for role, want in ((Role.PREFILL, num_prefill), (Role.DECODE, num_decode)):
            pool = self.workers[role]
            while len(pool) > want:
                await self._terminate(pool.pop())
            starts += [self._start_worker(role) for _ in range(want - len(pool))]
        await asyncio.gather(*starts)

    def _write_configs(self, etcd_url: str) -> None:
        """Each kind of child's configuration, as JSON in a directory of this user's only."""
        self._config_dir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        spec = self.spec
        for name, config in (("prefill", spec.prefill), ("decode", spec.decode), ("frontend", spec.frontend)):
            auth = config.etcd_auth
            if self._embedded is not None and config.cluster_tls is not None:
                auth = EtcdAuth(tls=config.cluster_tls.client)  # the embedded registry serves cluster mTLS
            config = msgspec.structs.replace(config, etcd=etcd_url, etcd_auth=auth)
            self._config_file(name).write_bytes(msgspec.json.encode(config))

    def _config_file(self, name: str) -> Path:
        assert self._config_dir is not None
        return self._config_dir / f"{name}.json"

    async def _start_worker(self, role: Role) -> None:
        self._count += 1
        child = await self._spawn(f"{role}-{self._count}", [role, "--config", str(self._config_file(role))])
        self.workers[role].append(child)

    async def _spawn(self, name: str, argv: list[str]) -> Child:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pdserve", *argv,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            env={**os.environ, PARENT_PID_ENV: str(os.getpid())},  # a killed `up` takes its children with it
        )  # fmt: skip
        child = Child(name, process)
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        child.reader = asyncio.get_running_loop().create_task(self._read(child, ready))
        try:
            async with asyncio.timeout(self.spec.start_timeout_s):
                child.address = await ready
        except (TimeoutError, ChildFailed) as exc:
            await self._terminate(child)
            last = "\n  ".join(child.output) or "(no output)"
            why = "did not start in time" if isinstance(exc, TimeoutError) else "exited"
            raise ChildFailed(f"{name} {why}; its last output:\n  {last}") from None
        return child

    async def _read(self, child: Child, ready: asyncio.Future[str]) -> None:
        """Forward the child's output (prefixed) and resolve ``ready`` at its listening line."""
        assert child.process.stdout is not None
        async for raw in child.process.stdout:
            line = raw.decode(errors="replace").rstrip()
            child.output.append(line)
            print(f"[{child.name}] {line}", file=sys.stderr, flush=True)
            if not ready.done() and _READY in line:
                ready.set_result(line.split(_READY, 1)[1].strip())
        if not ready.done():
            ready.set_exception(ChildFailed(child.name))

    async def _terminate(self, child: Child) -> None:
        """SIGTERM (the child drains), then SIGKILL after the stop timeout."""
        process = child.process
        if process.returncode is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                async with asyncio.timeout(self.spec.stop_timeout_s):
                    await process.wait()
            except TimeoutError:
                logger.warning(
                    "%s did not stop in %.0fs: dumping its stacks, then killing it", child.name, self.spec.stop_timeout_s
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, DUMP_SIGNAL)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_DUMP_WAIT_S):
                        await process.wait()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        if child.reader is not None:
            await asyncio.gather(child.reader, return_exceptions=True)

    def exited(self) -> list[Child]:
        """Children that died on their own."""
        children = [*self.workers[Role.PREFILL], *self.workers[Role.DECODE], *([self.frontend] if self.frontend else [])]
        return [c for c in children if c.process.returncode is not None]

    async def stop(self) -> None:
        """Stop the frontend first (no new requests), then drain every worker, then the registry."""
        if self.frontend is not None:
            await self._terminate(self.frontend)
            self.frontend = None
        children = [*self.workers[Role.PREFILL], *self.workers[Role.DECODE]]
        self.workers = {role: [] for role in Role}
        await asyncio.gather(*(self._terminate(c) for c in children))
        if self._embedded is not None:
            await self._embedded.stop()
            self._embedded = None
        if self._config_dir is not None:
            shutil.rmtree(self._config_dir, ignore_errors=True)
            self._config_dir = None
