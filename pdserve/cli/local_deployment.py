"""The deployment ``pdserve up`` runs on this machine, as the default of the commands beside it.

``status``, ``top``, ``workers``, ``drain``, ``slo`` and ``knobs`` given no etcd (no ``--etcd``, no
``$PDSERVE_ETCD``) take the registry's URL from the record ``up`` keeps in the state directory
(``pdserve.launch.deployment_record``), and its TLS unless etcd's TLS or auth settings are
given; ``drain`` given no ``--cluster-*`` also takes the tools' cluster certificate, which may
drain that deployment's workers. Explicit options win, each on its own.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve import environment
from pdserve.environment import ETCD_AUTH_SETTINGS, etcd_auth_setting
from pdserve.launch.deployment_record import DeploymentRecord, read_record


def local_deployment() -> DeploymentRecord | None:
    """The record of the ``up`` running beside this command, if one is."""
    return read_record(Path(environment.state_dir()))


def use_local_deployment(args: argparse.Namespace, *, cluster: bool = False) -> None:
    """Fill what ``args`` leaves out from the local deployment's record (see the module's
    docstring); ``cluster``: its cluster certificate set too (``--cluster-*``)."""
    record = None
    if not args.etcd:
        record = local_deployment()
        if record is None:
            return
        args.etcd = record.etcd
        given = [name for name in (*ETCD_AUTH_SETTINGS, "etcd_password_file") if getattr(args, name, None)]
        if record.etcd_tls is not None and not given and not any(map(etcd_auth_setting, ETCD_AUTH_SETTINGS)):
            etcd_tls = record.etcd_tls
            args.etcd_cacert, args.etcd_cert, args.etcd_key = etcd_tls.ca, etcd_tls.cert, etcd_tls.key
            args.etcd_server_name = etcd_tls.server_name
    if not cluster or args.cluster_ca or args.cluster_cert or args.cluster_key:
        return
    record = record or local_deployment()
    # Only for the deployment the command talks to: another etcd is another deployment.
    if record is not None and record.cluster_tls is not None and args.etcd in (None, record.etcd):
        tls = record.cluster_tls
        args.cluster_ca, args.cluster_cert, args.cluster_key = tls.ca, tls.cert, tls.key
        args.cluster_server_name = tls.server_name
