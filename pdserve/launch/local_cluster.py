"""A whole pdserve deployment on one machine, as supervised child processes (``pdserve up``).

``LocalCluster`` starts the registry (the given etcd, or a real etcd server process of its own,
``EtcdProcess``, with its data under the deployment's state directory), the frontend, and the
prefill and decode workers, each a ``python -m pdserve ...`` child (``Child``) with its own
engine and NIXL agent. A child gets its whole configuration, a ``WorkerConfig`` or
``FrontendConfig`` written as JSON, with ``--config FILE``, so a new option reaches it without
an edit here.

Once started, every child is supervised (``Supervisor``): one that dies is restarted with
back-off, the frontend on the port it first bound, the registry on its ports with its data.
A worker given up on (a crash loop), or one that exited cleanly after a drain it was asked for,
leaves its pool; the frontend or the registry given up on sets ``failed``. ``scale`` adds
workers or drains the newest ones (SIGTERM); ``stop`` drains every child, kills any still alive
after the grace period, then stops the registry. Nothing outlives the cluster, its state
directory (configuration files, etcd's data) included.

With the cluster's certificate set (the frontend configuration's ``cluster_tls``) the embedded
registry serves mTLS too, and every child reaches it presenting its own cluster certificate.
With ``auto_tls`` and no set given, the cluster makes its own at start (``certificates``: a CA
of its own and a certificate per component, in the state directory) and runs exactly as if
given them: the frontend presents ``pdserve-frontend``'s, the workers ``pdserve-worker``'s, the
embedded registry serves ``pdserve-registry``'s, and this process (and the tools beside it)
uses ``pdserve-tools``'s (``tools_tls``).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec

from pdserve.discovery.etcd_auth import EtcdAuth
from pdserve.discovery.registry import Role
from pdserve.frontend.config import FrontendConfig
from pdserve.launch.certificates import issue_deployment_certificates
from pdserve.launch.child import Child, ChildFailed
from pdserve.launch.etcd_process import EtcdFailed, EtcdProcess
from pdserve.launch.supervisor import RestartPolicy, Supervised, Supervisor
from pdserve.observability.metrics import SupervisorMetrics
from pdserve.rpc.admin import FRONTEND, REGISTRY, TOOLS, WORKER
from pdserve.rpc.tls import ClusterTLS
from pdserve.worker.config import WorkerConfig

__all__ = ["Child", "ChildFailed", "ClusterSpec", "LocalCluster"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterSpec:
    """Attributes:
    prefill / decode: the configuration of each worker of the pool.
    frontend: the frontend's configuration.
    etcd: an etcd URL, or None for an etcd server of the cluster's own (``EtcdProcess``). The
        registry is the cluster's: each child gets its URL as its configuration's ``etcd``,
        whatever that held.
    restart: how children that die are restarted.
    auto_tls: when the configurations carry no cluster certificate set, make one for this
        deployment at start (``certificates``), so that it runs with cluster mTLS all the same.
    """

    prefill: WorkerConfig
    decode: WorkerConfig
    frontend: FrontendConfig
    etcd: str | None = None
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 60.0
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    auto_tls: bool = False

    def __post_init__(self) -> None:
        if (self.prefill.role, self.decode.role) != (Role.PREFILL, Role.DECODE):
            raise ValueError(
                f"the prefill and decode configurations have the roles {self.prefill.role!r} and {self.decode.role!r}"
            )


class LocalCluster:
    """Attributes:
    etcd_url: the registry's URL, once started.
    registry: the cluster's own etcd, when it runs one.
    frontend: the frontend child, once started.
    workers: each pool's children, oldest first.
    gave_up: children given up on (or that exited cleanly), no longer in a pool.
    failed: set, with ``failure`` saying why, when the frontend or the registry was given up on.
    metrics: restarts and give-ups, for ``pdserve up``'s /metrics.
    tools_tls: the cluster certificate set of this process and the tools beside it (None
        without cluster mTLS).
    """

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.etcd_url: str | None = spec.etcd
        self.registry: EtcdProcess | None = None
        # How this process reaches the registry (as the frontend does).
        self.etcd_auth: EtcdAuth = spec.frontend.etcd_auth
        self.frontend: Child | None = None
        self.workers: dict[Role, list[Child]] = {role: [] for role in Role}
        self.gave_up: list[Supervised] = []
        self.failed = asyncio.Event()
        self.failure = ""
        self.metrics = SupervisorMetrics()
        self._supervisor = Supervisor(spec.restart, self.metrics, self._on_give_up, self._is_done)
        self._count = 0
        self._state_dir: Path | None = None  # configuration files, the registry's data, certificates
        self.tools_tls: ClusterTLS | None = spec.frontend.cluster_tls

    async def start(self, num_prefill: int, num_decode: int) -> None:
        """Start the registry, the workers and the frontend; all ready, or ChildFailed."""
        try:
            self._state_dir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
            registry_tls = self.tools_tls
            if self.spec.auto_tls and self.tools_tls is None:
                registry_tls = self._issue_certificates(self._state_dir / "tls")
            if self.etcd_url is None:
                self.registry = EtcdProcess(self._state_dir / "etcd", tls=registry_tls)
                try:
                    self.etcd_url = await self.registry.start()
                except EtcdFailed as exc:
                    raise ChildFailed(f"the registry did not start: {exc}") from None
                self._supervisor.watch(self.registry)
                if self.tools_tls is not None:
                    self.etcd_auth = EtcdAuth(tls=self.tools_tls.client)
            self._write_configs(self.etcd_url)
            await self.scale(num_prefill, num_decode)
            frontend = self._child("frontend", "frontend", ["frontend", "--config", str(self._config_file("frontend"))])
            await frontend.start()
            self.frontend = frontend
            self._pin_frontend_ports(frontend)
            self._supervisor.watch(frontend)
        except BaseException:
            await self.stop()
            raise

    async def scale(self, num_prefill: int, num_decode: int) -> None:
        """Start workers up to, or drain the newest down to, the given counts."""
        starts = []
        for role, want in ((Role.PREFILL, num_prefill), (Role.DECODE, num_decode)):
            pool = self.workers[role]
            while len(pool) > want:
                child = pool.pop()
                await self._supervisor.release(child)
                await child.stop()
            starts += [self._start_worker(role) for _ in range(want - len(pool))]
        await asyncio.gather(*starts)

    def exited(self) -> list[Child]:
        """Children that are dead now: died and not (yet) restarted, or given up on."""
        children = [
            *self.workers[Role.PREFILL],
            *self.workers[Role.DECODE],
            *([self.frontend] if self.frontend else []),
        ]
        given_up = [c for c in self.gave_up if isinstance(c, Child)]
        return [c for c in children if not c.is_alive] + given_up

    async def stop(self) -> None:
        """Stop supervising; stop the frontend first (no new requests), then drain every
        worker, then the registry."""
        await self._supervisor.close()
        if self.frontend is not None:
            await self.frontend.stop()
            self.frontend = None
        children = [*self.workers[Role.PREFILL], *self.workers[Role.DECODE]]
        self.workers = {role: [] for role in Role}
        await asyncio.gather(*(c.stop() for c in children))
        if self.registry is not None:
            await self.registry.stop()
            self.registry = None
        if self._state_dir is not None:
            shutil.rmtree(self._state_dir, ignore_errors=True)
            self._state_dir = None

    def _issue_certificates(self, directory: Path) -> ClusterTLS:
        """Give every configuration its component's certificate from a CA of this deployment's
        own; returns the registry's."""
        issued = issue_deployment_certificates(directory)
        spec = self.spec

        def with_tls(config: WorkerConfig, name: str) -> WorkerConfig:
            return msgspec.structs.replace(config, cluster_tls=issued[name])

        self.spec = replace(
            spec,
            prefill=with_tls(spec.prefill, WORKER),
            decode=with_tls(spec.decode, WORKER),
            frontend=msgspec.structs.replace(spec.frontend, cluster_tls=issued[FRONTEND]),
        )
        self.tools_tls = issued[TOOLS]
        logger.info("cluster mTLS with certificates of this deployment's own CA, in %s", directory)
        return issued[REGISTRY]

    def _write_configs(self, etcd_url: str) -> None:
        """Each kind of child's configuration, as JSON in the state directory (this user's only)."""
        spec = self.spec
        for name, config in (("prefill", spec.prefill), ("decode", spec.decode), ("frontend", spec.frontend)):
            auth = config.etcd_auth
            if self.registry is not None and config.cluster_tls is not None:
                auth = EtcdAuth(tls=config.cluster_tls.client)  # the embedded registry serves cluster mTLS
            config = msgspec.structs.replace(config, etcd=etcd_url, etcd_auth=auth)
            self._config_file(name).write_bytes(msgspec.json.encode(config))

    def _pin_frontend_ports(self, frontend: Child) -> None:
        """A restarted frontend listens where the first one did (clients keep their targets)."""
        port = int(frontend.address.rsplit(":", 1)[1])
        http_port = self.spec.frontend.http_port
        if frontend.http_url:
            http_port = int(frontend.http_url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
        path = self._config_file("frontend")
        written = msgspec.json.decode(path.read_bytes(), type=FrontendConfig)
        path.write_bytes(msgspec.json.encode(msgspec.structs.replace(written, port=port, http_port=http_port)))

    def _config_file(self, name: str) -> Path:
        assert self._state_dir is not None
        return self._state_dir / f"{name}.json"

    def _child(self, name: str, role: str, argv: list[str]) -> Child:
        return Child(
            name, role, argv, start_timeout_s=self.spec.start_timeout_s, stop_timeout_s=self.spec.stop_timeout_s
        )

    async def _start_worker(self, role: Role) -> None:
        self._count += 1
        child = self._child(f"{role}-{self._count}", str(role), [role, "--config", str(self._config_file(role))])
        await child.start()
        self.workers[role].append(child)
        self._supervisor.watch(child)

    def _is_done(self, child: Supervised, code: int) -> bool:
        # A worker that exits cleanly drained on request (`pdserve drain`, SIGTERM): let it go.
        return code == 0 and child.role in (Role.PREFILL, Role.DECODE)

    def _on_give_up(self, child: Supervised, why: str) -> None:
        self.gave_up.append(child)
        for pool in self.workers.values():
            if any(c is child for c in pool):
                pool[:] = [c for c in pool if c is not child]
                return
        self.failure = f"{child.name} {why}, and was given up on"
        self.failed.set()
