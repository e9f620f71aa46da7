"""The control plane: the etcd worker registry, metrics, SLO targets and the planner.

``registry`` is the key layout and the entries; ``registration`` the worker's side of it and
``registry_view`` the readers'; ``etcd`` reaches a real etcd; ``embedded_etcd`` stands in for
one on a single machine.
"""

from pdserve.control_plane.embedded_etcd import EmbeddedEtcd
from pdserve.control_plane.etcd import EtcdEndpoint, RegistryUnavailable, connect
from pdserve.control_plane.registration import WorkerRegistration
from pdserve.control_plane.registry import WorkerEntry, WorkerLoad, list_workers
from pdserve.control_plane.registry_view import RegistryView

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
