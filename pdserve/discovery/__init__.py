"""Discovery: everything pdserve keeps in etcd, and the client that reaches it.

Every process runs this, data plane and control plane alike.
- ``registry``: the key layout and the worker entries; ``registration`` is the worker's side
  of it (a lease-kept entry) and ``registry_view`` the readers' (a view kept current by
  ``watch``, which follows key ranges by etcd watch).
- ``knobs`` and ``knobs_follower``: a model's live knobs and the loop that applies them.
- ``slo`` and ``slo_store``: a model's latency targets.
- ``etcd`` reaches a real etcd through one connection a process shares; ``retry`` outlives
  its outages.
- ``etcd_auth``: ``EtcdAuth``, how a process proves itself to etcd: TLS (the CA, a client
  certificate) and etcd's own user and password.
"""

from pdserve.discovery.etcd import EtcdEndpoint, RegistryUnavailable, connect
from pdserve.discovery.registration import WorkerRegistration
from pdserve.discovery.registry import Role, WorkerEntry, list_workers
from pdserve.discovery.registry_view import RegistryView

__all__ = [
    "EtcdEndpoint",
    "RegistryUnavailable",
    "RegistryView",
    "Role",
    "WorkerEntry",
    "WorkerRegistration",
    "connect",
    "list_workers",
]
