"""The control plane: the etcd worker registry (and, later, metrics, the SLO planner, the operator).

``registry`` is the key layout and the worker-side and reader-side halves of it; ``etcd``
reaches a real etcd; ``embedded_etcd`` stands in for one on a single machine.
"""

from pdserve.control_plane.embedded_etcd import EmbeddedEtcd
from pdserve.control_plane.etcd import EtcdEndpoint, RegistryUnavailable, connect
from pdserve.control_plane.registry import (
    RegistryView,
    WorkerEntry,
    WorkerLoad,
    WorkerRegistration,
    list_workers,
)

__all__ = [
    "EmbeddedEtcd",
    "EtcdEndpoint",
    "RegistryUnavailable",
    "RegistryView",
    "WorkerEntry",
    "WorkerLoad",
    "WorkerRegistration",
    "connect",
    "list_workers",
]
