"""A deployment's own certificate authority, made at start when ``pdserve up`` is given none.

Contract: ``issue_deployment_certificates(directory)`` creates ``directory`` (mode 0700; it
must not exist yet) and writes into it a fresh CA certificate (``ca.pem``) and, for each
component of ``COMPONENTS``, a certificate and its key (``NAME.pem``, ``NAME-key.pem``, keys
mode 0600); it returns each component's ``ClusterTLS``. The CA's private key never touches
the disk: once the certificates are signed nobody can issue another, so the set is exactly
what this deployment holds, and it dies with the directory.

Like etcd's ``--auto-tls``, but every certificate chains to one CA and carries what pdserve's
cluster mTLS checks (README: Security): EC P-256 keys; the subject alternative names
``DNS:<server_name>`` (``pdserve-cluster``), 127.0.0.1 and ::1; server and client
authentication; a short validity (``VALIDITY``). Each component's common name is its role
(``pdserve.rpc.admin``'s ``FRONTEND``, ``WORKER``, ``TOOLS``, ``REGISTRY``), which the workers
read to decide who may call what.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.rpc.admin import FRONTEND, REGISTRY, TOOLS, WORKER
from pdserve.rpc.tls import DEFAULT_CLUSTER_SERVER_NAME, ClusterTLS

COMPONENTS = (FRONTEND, WORKER, TOOLS, REGISTRY)
# Long enough for any one run of `up`, short enough that a copied key soon stops mattering.
VALIDITY = datetime.timedelta(days=30)
# Clocks of processes on one machine agree; this covers a clock stepped back a little.
_BACKDATE = datetime.timedelta(minutes=5)
_LOOPBACK = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file that only this user can read, from its first byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=ca,
        crl_sign=ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not ca,
        encipher_only=False,
        decipher_only=False,
    )


def issue_deployment_certificates(
    directory: Path, server_name: str = DEFAULT_CLUSTER_SERVER_NAME, validity: datetime.timedelta = VALIDITY
) -> dict[str, ClusterTLS]:
    """A new CA and one certificate per component in ``directory``; each component's set,
    by common name. Raises FileExistsError when ``directory`` exists."""
    directory.mkdir(mode=0o700, parents=False)
    directory.chmod(0o700)  # whatever the umask
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"pdserve deployment CA {now:%Y%m%dT%H%M%SZ}")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path = directory / "ca.pem"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    sans = x509.SubjectAlternativeName([x509.DNSName(server_name), *(x509.IPAddress(ip) for ip in _LOOPBACK)])
    usages = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    issued = {}
    for common_name in COMPONENTS:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(now + validity)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(ca=False), critical=True)
            .add_extension(usages, critical=False)
            .add_extension(sans, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        cert_path, key_path = directory / f"{common_name}.pem", directory / f"{common_name}-key.pem"
        _write_private(
            key_path,
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        )
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        issued[common_name] = ClusterTLS(
            ca=str(ca_path), cert=str(cert_path), key=str(key_path), server_name=server_name
        )
    return issued
