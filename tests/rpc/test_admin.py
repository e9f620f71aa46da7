"""Who may call ``Drain`` and the serving RPCs: ``AdminPolicy`` on a real grpc.aio server, over
plaintext and mTLS, with certificates naming pdserve's components and others."""

from __future__ import annotations

import grpc
import pytest

from pdserve.rpc.admin import AdminPolicy, admin_metadata
from pdserve.rpc.server import RpcServer
from pdserve.rpc.tls import ClientTLS, ServerTLS, secure_or_insecure_channel
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.utils.aio import run_scenario
from tests.utils.certs import CertificateAuthority


class Guarded(worker_pb2_grpc.WorkerServicer):
    """Drain as a worker guards it (``WorkerServicer.Drain``), without the worker."""

    def __init__(self, policy: AdminPolicy) -> None:
        self.policy = policy

    async def Drain(self, request, context):
        await self.policy.authorize(context, "Drain")
        return worker_pb2.DrainResponse(in_flight=3)

    async def Prefill(self, request, context):
        await self.policy.check_caller(context, "Prefill")
        return worker_pb2.PrefillResponse(worker_id="w")


def _drain(
    policy: AdminPolicy,
    calls: dict[str, tuple[ClientTLS | None, str | None]],
    tls: ServerTLS | None = None,
    rpc: str = "Drain",
) -> dict[str, str]:
    """Each call's outcome: OK, or its code and details."""

    async def main():
        server = RpcServer(tls=tls)
        server.add(lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(Guarded(policy), s), "pdserve.v1.Worker")
        port = await server.start("127.0.0.1", 0)
        outcomes = {}
        try:
            for name, (client_tls, key) in calls.items():
                async with secure_or_insecure_channel(f"127.0.0.1:{port}", client_tls) as channel:
                    try:
                        stub = worker_pb2_grpc.WorkerStub(channel)
                        if rpc == "Drain":
                            await stub.Drain(worker_pb2.DrainRequest(), metadata=admin_metadata(key), timeout=5)
                        else:
                            await stub.Prefill(worker_pb2.PrefillRequest(), timeout=5)
                        outcomes[name] = "OK"
                    except grpc.aio.AioRpcError as error:
                        outcomes[name] = f"{error.code().name}: {error.details()}"
        finally:
            await server.stop(0)
        return outcomes

    return run_scenario(main(), 60)


def test_with_an_admin_key_drain_needs_it():
    outcomes = _drain(
        AdminPolicy("s3cret", verified_peers=False),
        {
            "none": (None, None),
            "wrong": (None, "guess"),
            "right": (None, "s3cret"),
        },
    )
    assert outcomes["right"] == "OK"
    assert outcomes["none"].startswith("UNAUTHENTICATED: Drain needs the admin key")
    assert outcomes["wrong"] == "PERMISSION_DENIED: Drain: wrong admin key"


def test_under_mtls_a_verified_peer_may_drain_and_the_key_is_not_needed(tmp_path):
    ca = CertificateAuthority(tmp_path, "cluster")
    member = ca.cluster_tls("operator")
    outcomes = _drain(AdminPolicy(None, verified_peers=True), {"member": (member.client, None)}, tls=member.server)
    assert outcomes == {"member": "OK"}


def test_a_client_certificate_the_server_does_not_verify_admits_nobody(tmp_path):
    # TLS without a client CA: a certificate the client shows was never checked.
    ca = CertificateAuthority(tmp_path, "cluster")
    calls = {"with a certificate": (ca.client_tls("stranger"), None), "with the key": (ClientTLS(ca=ca.ca), "k")}
    outcomes = _drain(AdminPolicy("k", verified_peers=False), calls, tls=ca.server_tls())
    assert outcomes["with the key"] == "OK"
    assert outcomes["with a certificate"].startswith("UNAUTHENTICATED")


def test_without_mtls_or_a_key_drain_is_open_and_an_empty_key_is_refused():
    assert _drain(AdminPolicy(None, verified_peers=False), {"anyone": (None, None)}) == {"anyone": "OK"}
    with pytest.raises(ValueError, match="admin key must not be empty"):
        AdminPolicy("", verified_peers=False)


def _components(tmp_path):
    ca = CertificateAuthority(tmp_path, "cluster")
    names = ("pdserve-frontend", "pdserve-worker", "pdserve-tools", "pdserve-operator", "pdserve-registry", "shared")
    return ca.cluster_tls("pdserve-worker").server, {name: (ca.cluster_tls(name).client, None) for name in names}


def test_under_mtls_only_a_frontends_certificate_may_prefill(tmp_path):
    server, calls = _components(tmp_path)
    outcomes = _drain(AdminPolicy(None, verified_peers=True), calls, tls=server, rpc="Prefill")
    # A certificate naming no component (one set shared by all, made by hand) is held to nothing.
    assert {name for name, outcome in outcomes.items() if outcome == "OK"} == {"pdserve-frontend", "shared"}
    assert outcomes["pdserve-tools"] == (
        "PERMISSION_DENIED: Prefill is for pdserve-frontend only: "
        "the caller's certificate names 'pdserve-tools' (its common name)"
    )


def test_under_mtls_only_the_tools_operators_or_a_workers_own_certificate_may_drain(tmp_path):
    server, calls = _components(tmp_path)
    outcomes = _drain(AdminPolicy(None, verified_peers=True), calls, tls=server)
    # A worker pod's preStop drains its worker with the pod's (a worker's) certificate.
    assert {name for name, outcome in outcomes.items() if outcome == "OK"} == {
        "pdserve-tools",
        "pdserve-operator",
        "pdserve-worker",
        "shared",
    }
    assert outcomes["pdserve-frontend"].startswith(
        "PERMISSION_DENIED: Drain is for pdserve-operator or pdserve-tools or pdserve-worker"
    )
    # A worker given an admin key as well drains for a frontend's certificate that sends it.
    calls = {"frontend with the key": (calls["pdserve-frontend"][0], "k")}
    assert _drain(AdminPolicy("k", verified_peers=True), calls, tls=server) == {"frontend with the key": "OK"}


def test_without_mtls_prefill_is_open():
    assert _drain(AdminPolicy("k", verified_peers=False), {"anyone": (None, None)}, rpc="Prefill") == {"anyone": "OK"}
