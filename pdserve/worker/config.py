"""A worker's configuration (the ``pdserve prefill`` / ``pdserve decode`` options, or the
JSON file ``pdserve up`` hands each worker with ``--config``)."""

from __future__ import annotations

import os
import socket

import msgspec

from pdserve.discovery.etcd_auth import EtcdAuth
from pdserve.discovery.registry import Role
from pdserve.distributed.interfaces import interface_for
from pdserve.distributed.parallel_config import ParallelConfig
from pdserve.distributed.placement import GroupPlacement
from pdserve.model.default_model import served_name
from pdserve.rpc.tls import ClusterTLS
from pdserve.types.engine_config import EngineConfig


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Attributes:
    role: prefill or decode (a str is taken as its Role).
    model: the Hugging Face model directory or GGUF file.
    etcd: the registry's URL.
    model_name: the served name (default: ``default_model.served_name``: the directory's name,
        a GGUF file's less its quantization suffix, SmolLM2-135M-Instruct for the default model).
    host / port: where the gRPC server listens (port 0: a free one).
    advertise_host: the host others reach it at (default: ``host``, or the hostname for 0.0.0.0).
    worker_id: its name in the registry and NIXL (default: role-hostname-pid).
    lease_ttl_s: a worker that stops renewing disappears from routing after this long.
    hold_s: prefill: how long a request's blocks stay pinned waiting for the decode side's pull.
    transfer_timeout_s: decode: the deadline of one KV pull.
    drain_timeout_s: SIGTERM or Drain: how long in-flight requests may take to finish.
    metrics_port: Prometheus /metrics port, with the /readyz and /livez probes (0: a free one,
        published in the registry; None: off).
    liveness_deadline_s: /livez fails once the engine thread has not come round its loop for
        this long: longer than the longest legitimate step (a big prefill on CPU).
    num_threads: torch CPU threads (None: torch's default).
    engine: how its engine runs the model.
    parallel: how many ranks (processes) the worker spreads its model over. Tensor
        parallelism: one worker whose ranks each move their own KV heads over NIXL.
        Data-parallel attention with expert parallelism: one worker per rank (its own
        scheduler, KV cache and registry entry, ``{worker_id}-dp{rank}`` past rank 0), the
        ranks sharing the experts and stepping together.
    placement: this process's rank in a group whose ranks run as separate processes, possibly
        on other hosts (None: rank 0 starts the other ranks itself, on its own host). Every
        rank of such a group gets the same configuration but its placement's index.
    cluster_tls: the cluster's certificate set: the gRPC server then serves mTLS only, to
        clients with a certificate from the cluster CA.
    admin_key: the key a ``Drain`` caller without a cluster certificate must send; with
        neither, ``Drain`` is open to anyone who reaches the port.
    etcd_auth: etcd's TLS settings and user.
    """

    role: Role
    model: str
    etcd: str
    model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    worker_id: str | None = None
    lease_ttl_s: float = 5.0
    hold_s: float = 30.0
    transfer_timeout_s: float = 30.0
    drain_timeout_s: float = 60.0
    metrics_port: int | None = 0
    liveness_deadline_s: float = 60.0
    num_threads: int | None = None
    engine: EngineConfig = EngineConfig()
    parallel: ParallelConfig = ParallelConfig()
    placement: GroupPlacement | None = None
    cluster_tls: ClusterTLS | None = None
    admin_key: str | None = None
    etcd_auth: EtcdAuth = EtcdAuth()

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "role", Role.parse(self.role))
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("lease_ttl_s", "hold_s", "transfer_timeout_s", "drain_timeout_s", "liveness_deadline_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.admin_key is not None and not self.admin_key:
            raise ValueError("admin_key must not be empty")
        if self.placement is not None and self.placement.group_size != self.parallel.world_size:
            raise ValueError(
                f"group size {self.placement.group_size} does not match the group's ranks: tensor_parallel_size "
                f"{self.parallel.tensor_parallel_size} x data_parallel_size {self.parallel.data_parallel_size} = "
                f"{self.parallel.world_size}"
            )

    @property
    def served_model_name(self) -> str:
        return self.model_name or served_name(self.model)

    @property
    def id(self) -> str:
        return self.worker_id or f"{self.role}-{socket.gethostname()}-{os.getpid()}"

    @property
    def reachable_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host

    @property
    def loopback_only(self) -> bool:
        """Reached at a loopback address: every peer is on this machine, so its KV agents
        listen on loopback alone."""
        return interface_for(self.reachable_host) == "lo"
