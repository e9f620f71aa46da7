"""The operator's credentials for a deployment's own etcd, read from the Secrets its spec names.

The operator reads each deployment's etcd (workers registered, SLO targets) with the same TLS
and user that the deployment's pods get: ``spec.etcd.tls``'s CA (and client certificate, with
``clientCertificate``) and ``spec.etcd.auth``'s ``username`` and ``password``. It reads those
Secrets through the API (get on secrets, nothing else) at each registry read.

Contract: ``etcd_auth`` writes the PEM files into ``directory``, which the caller owns and
removes once the etcd client is closed (``tempfile.TemporaryDirectory``: mode 0700, so no other
user reads the key); nothing else is kept. It raises ``ValueError`` naming the field and the
Secret when a Secret or one of its keys is missing or unreadable, never showing a value.
"""

from __future__ import annotations

import base64
from pathlib import Path

from pdserve.discovery.etcd_auth import EtcdAuth
from pdserve.operator.kube import ApiException, Kube, object_path
from pdserve.operator.spec import EtcdSpec
from pdserve.rpc.tls import ClientTLS


def etcd_auth(kube: Kube, namespace: str, etcd: EtcdSpec, directory: Path) -> EtcdAuth:
    """The ``EtcdAuth`` of ``etcd`` (``spec.etcd``), its TLS files written into ``directory``."""
    tls = None
    if etcd.tls is not None:
        wanted = ["ca.crt"] + (["tls.crt", "tls.key"] if etcd.tls.client_certificate else [])
        data = _secret(kube, namespace, etcd.tls.secret_name, wanted, "spec.etcd.tls")
        for key, value in data.items():
            path = directory / key
            path.write_bytes(value)
            path.chmod(0o600)
        client = etcd.tls.client_certificate
        tls = ClientTLS(
            ca=str(directory / "ca.crt"),
            cert=str(directory / "tls.crt") if client else None,
            key=str(directory / "tls.key") if client else None,
            server_name=etcd.server_name,
        )
    elif etcd.server_name is not None:
        tls = ClientTLS(server_name=etcd.server_name)
    if etcd.auth is None:
        return EtcdAuth(tls=tls)
    data = _secret(kube, namespace, etcd.auth.secret_name, ["username", "password"], "spec.etcd.auth")
    try:
        user, password = data["username"].decode(), data["password"].decode()
    except UnicodeDecodeError:
        raise ValueError(
            f"spec.etcd.auth: Secret {etcd.auth.secret_name}'s username and password must be UTF-8"
        ) from None
    return EtcdAuth(tls=tls, user=user, password=password)


def _secret(kube: Kube, namespace: str, name: str, keys: list[str], where: str) -> dict[str, bytes]:
    """``keys`` of Secret ``namespace/name``, decoded; ValueError naming ``where`` and what is missing."""
    try:
        secret = kube.get(object_path("Secret", namespace, name))
    except ApiException as error:
        raise ValueError(
            f"{where}: cannot read Secret {namespace}/{name}: {error.status} {error.reason} "
            "(the operator needs get on secrets in this namespace)"
        ) from None
    if secret is None:
        raise ValueError(f"{where}.secretName: no Secret {name!r} in namespace {namespace}")
    data = secret.get("data") or {}
    missing = [key for key in keys if not data.get(key)]
    if missing:
        raise ValueError(f"{where}: Secret {namespace}/{name} has no {', '.join(missing)}")
    return {key: base64.b64decode(data[key]) for key in keys}
