"""The running deployment that ``pdserve up`` records for the ``pdserve`` commands run beside it.

Contract: ``write_record`` puts ``deployment.json`` in the state directory
(``environment.state_dir()``; made mode 0700, the file 0600) once the deployment serves:
its registry's URL, the TLS that reaches the registry, the certificate set of the tools
(``pdserve-tools``, which may drain a worker) and the API's address. ``remove_record`` deletes
it when ``up`` stops, but only while it still names that ``up`` (its pid). ``read_record``
returns None when there is none, or when the process that wrote it is gone (killed before it
could clean up).

One ``up`` per state directory: a second one on the same directory overwrites the record, so
the commands reach the newer deployment; the first, stopping, leaves the newer record alone,
and once the newer stops there is no record until an ``up`` starts again. Give each its own
``$PDSERVE_STATE_DIR`` to keep both reachable.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from pdserve.rpc.tls import ClientTLS, ClusterTLS

RECORD_FILE = "deployment.json"


class DeploymentRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Attributes:
    pid: the ``pdserve up`` process.
    etcd: the registry's URL.
    etcd_tls: how a client reaches it over TLS (None: plaintext).
    cluster_tls: the tools' cluster certificate set (None: the workers serve plaintext).
    api: the public gRPC API's address, ``host:port``.
    """

    pid: int
    etcd: str
    etcd_tls: ClientTLS | None = None
    cluster_tls: ClusterTLS | None = None
    api: str = ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive, but not this user's deployment
    return True


def write_record(state_dir: Path, record: DeploymentRecord) -> Path:
    """Write ``record`` (atomically, readable by this user alone); returns its path."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    state_dir.chmod(0o700)
    path = state_dir / RECORD_FILE
    partial = state_dir / f".{RECORD_FILE}.{os.getpid()}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(msgspec.json.encode(record))
    partial.replace(path)
    return path


def read_record(state_dir: Path) -> DeploymentRecord | None:
    """The record of a live ``up`` in ``state_dir``, or None."""
    try:
        record = msgspec.json.decode((state_dir / RECORD_FILE).read_bytes(), type=DeploymentRecord)
    except (OSError, msgspec.DecodeError):
        return None
    return record if _alive(record.pid) else None


def remove_record(state_dir: Path, pid: int) -> None:
    """Delete the record if it is ``pid``'s."""
    path = state_dir / RECORD_FILE
    try:
        record = msgspec.json.decode(path.read_bytes(), type=DeploymentRecord)
    except (OSError, msgspec.DecodeError):
        return
    if record.pid == pid:
        path.unlink(missing_ok=True)
