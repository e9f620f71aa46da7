"""Every ``PDSERVE_*`` environment variable pdserve reads, each read here by one function and
nowhere else; an option that defaults to one names it in its help. Standard library only.

- ``PDSERVE_ETCD``: the registry's URL (``etcd_url``);
- ``PDSERVE_ETCD_CACERT``, ``_CERT``, ``_KEY``, ``_SERVER_NAME``, ``_USER``, ``_PASSWORD``: etcd's
  TLS and auth (``etcd_auth_setting``);
- ``PDSERVE_API_KEY``: the key a client presents (``api_key``); ``PDSERVE_API_KEYS``: the keys a
  frontend accepts, comma-separated (``api_keys``);
- ``PDSERVE_ADMIN_KEY``: the key that drains a worker (``admin_key``);
- ``PDSERVE_LOG_LEVEL``, ``PDSERVE_LOG_FORMAT``: the defaults of ``--log-level`` and
  ``--log-format`` (``log_setting``), which the ``pdserve`` command exports for its children;
- ``PDSERVE_CACHE_DIR``: pdserve's cache directory (``cache_dir``);
- ``PDSERVE_KERNEL_DIR``: a read-only directory of prebuilt CPU kernels, looked in before the
  cache (``kernel_dir``; the CPU image sets it);
- ``PDSERVE_PLANNER_CLUSTER_ROLE``: the ClusterRole the operator binds planners to
  (``planner_cluster_role``; the chart sets it);
- ``PDSERVE_PARENT_PID``: set by ``pdserve up`` for its children (``PARENT_PID``, ``parent_pid``);
- ``PDSERVE_STATE_DIR``: where ``pdserve up`` records its running deployment for the commands run
  beside it (``state_dir``; else ``$XDG_RUNTIME_DIR/pdserve``, else ``~/.local/state/pdserve``).

Beside them, the three a LeaderWorkerSet sets in its pods, which place a worker's rank in a group
across hosts (``group_setting``): ``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``.
"""

from __future__ import annotations

import os

PARENT_PID = "PDSERVE_PARENT_PID"
GROUP_SETTINGS = {
    "leader_address": "LWS_LEADER_ADDRESS",
    "group_size": "LWS_GROUP_SIZE",
    "group_index": "LWS_WORKER_INDEX",
}
ETCD_AUTH_SETTINGS = ("etcd_cacert", "etcd_cert", "etcd_key", "etcd_server_name", "etcd_user", "etcd_password")


def _read(name: str) -> str | None:
    return os.environ.get(name) or None  # set but empty reads as unset


def etcd_url() -> str | None:
    return _read("PDSERVE_ETCD")


def etcd_auth_setting(setting: str) -> str | None:
    """``$PDSERVE_ETCD_CACERT`` for ``"etcd_cacert"``, and so on for each of ``ETCD_AUTH_SETTINGS``."""
    if setting not in ETCD_AUTH_SETTINGS:
        raise ValueError(f"no etcd setting {setting!r}; one of {', '.join(ETCD_AUTH_SETTINGS)}")
    return _read(f"PDSERVE_{setting.upper()}")


def api_key() -> str | None:
    return _read("PDSERVE_API_KEY")


def api_keys() -> list[str]:
    return [key.strip() for key in (_read("PDSERVE_API_KEYS") or "").split(",") if key.strip()]


def admin_key() -> str | None:
    return _read("PDSERVE_ADMIN_KEY")


LOG_SETTINGS = {"log_level": "PDSERVE_LOG_LEVEL", "log_format": "PDSERVE_LOG_FORMAT"}


def log_setting(setting: str) -> str | None:
    """``$PDSERVE_LOG_LEVEL`` for ``"log_level"``, ``$PDSERVE_LOG_FORMAT`` for ``"log_format"``."""
    return _read(LOG_SETTINGS[setting])


def log_env(level: str, log_format: str) -> dict[str, str]:
    """The variables that hand ``--log-level`` and ``--log-format`` down to child processes."""
    return {LOG_SETTINGS["log_level"]: level, LOG_SETTINGS["log_format"]: log_format}


def cache_dir() -> str | None:
    return _read("PDSERVE_CACHE_DIR")


def kernel_dir() -> str | None:
    return _read("PDSERVE_KERNEL_DIR")


def planner_cluster_role() -> str | None:
    return _read("PDSERVE_PLANNER_CLUSTER_ROLE")


def parent_pid() -> str | None:
    return _read(PARENT_PID)


def state_dir() -> str:
    """``$PDSERVE_STATE_DIR``, else ``$XDG_RUNTIME_DIR/pdserve`` (a per-user, in-memory directory
    the login session owns), else ``~/.local/state/pdserve``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR") or None
    fallback = os.path.join(runtime, "pdserve") if runtime else os.path.expanduser("~/.local/state/pdserve")
    return _read("PDSERVE_STATE_DIR") or fallback


def group_setting(setting: str) -> str | None:
    """The LeaderWorkerSet variable behind ``setting`` (a key of ``GROUP_SETTINGS``)."""
    return _read(GROUP_SETTINGS[setting])
