"""TLS and mTLS on a real grpc.aio server (``RpcServer``) and a real asyncio TLS server, with
a CA and certificates made by the test: who is let in, who is refused, and why."""

from __future__ import annotations

import asyncio
import ssl

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.rpc.server import RpcServer
from pdserve.rpc.tls import ClientTLS, ClusterTLS, ServerTLS, secure_or_insecure_channel
from tests.utils.aio import run_scenario
from tests.utils.certs import CertificateAuthority


@pytest.fixture(scope="module")
def cas(tmp_path_factory):
    directory = tmp_path_factory.mktemp("certs")
    return CertificateAuthority(directory, "cluster"), CertificateAuthority(directory, "other")


async def _check(port: int, tls: ClientTLS | None) -> grpc.StatusCode:
    """The status of one health check against 127.0.0.1:port."""
    async with secure_or_insecure_channel(f"127.0.0.1:{port}", tls) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def _serve_and_check(server_tls: ServerTLS, clients: dict[str, ClientTLS | None]) -> dict[str, grpc.StatusCode]:
    async def main():
        server = RpcServer(tls=server_tls)
        port = await server.start("127.0.0.1", 0)
        try:
            return {name: await _check(port, tls) for name, tls in clients.items()}
        finally:
            await server.stop(0)

    return run_scenario(main(), 60)


def test_an_mtls_server_refuses_clients_without_a_certificate_or_with_another_cas(cas):
    cluster, other = cas
    server = cluster.server_tls(client_ca=cluster.ca)
    outcomes = _serve_and_check(
        server,
        {
            "cluster client": cluster.client_tls("frontend"),
            "no certificate": ClientTLS(ca=cluster.ca),
            "another CA's certificate": other.client_tls("intruder", ca=cluster.ca),
            "plaintext": None,
        },
    )
    assert outcomes == {
        "cluster client": grpc.StatusCode.OK,
        "no certificate": grpc.StatusCode.UNAVAILABLE,
        "another CA's certificate": grpc.StatusCode.UNAVAILABLE,
        "plaintext": grpc.StatusCode.UNAVAILABLE,
    }


def test_a_tls_server_without_a_client_ca_serves_any_client_that_trusts_it(cas):
    cluster, other = cas
    outcomes = _serve_and_check(
        cluster.server_tls(),
        {
            "trusting": ClientTLS(ca=cluster.ca),
            "trusting another CA": ClientTLS(ca=other.ca),
        },
    )
    assert outcomes == {"trusting": grpc.StatusCode.OK, "trusting another CA": grpc.StatusCode.UNAVAILABLE}


def test_cluster_members_check_the_cluster_server_name_not_the_address_dialled(cas):
    cluster, _ = cas
    worker = cluster.cluster_tls("worker")  # names only pdserve-cluster: not 127.0.0.1
    frontend = cluster.cluster_tls("frontend")
    named_for_another = ClusterTLS(ca=cluster.ca, cert=frontend.cert, key=frontend.key, server_name="elsewhere")
    outcomes = _serve_and_check(
        worker.server,
        {
            "member": frontend.client,
            "checking the address": ClientTLS(ca=cluster.ca, cert=frontend.cert, key=frontend.key),
            "checking another name": named_for_another.client,
        },
    )
    assert outcomes == {
        "member": grpc.StatusCode.OK,
        "checking the address": grpc.StatusCode.UNAVAILABLE,
        "checking another name": grpc.StatusCode.UNAVAILABLE,
    }


def test_bad_tls_files_are_named(cas, tmp_path):
    cluster, other = cas
    good = cluster.issue("good")
    stranger = other.issue("stranger")
    with pytest.raises(ValueError, match=f"TLS server certificate {tmp_path}/missing.pem: No such file"):
        ServerTLS(cert=str(tmp_path / "missing.pem"), key=good.key).check()
    (tmp_path / "text.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="text.pem: not a PEM file"):
        ServerTLS(cert=good.cert, key=good.key, client_ca=str(tmp_path / "text.pem")).check()
    with pytest.raises(ValueError, match="are not a certificate and its key"):
        ServerTLS(cert=good.cert, key=stranger.key).check()
    with pytest.raises(ValueError, match="give both or neither"):
        ClientTLS(ca=cluster.ca, cert=good.cert)


def test_the_ssl_context_serves_mtls_to_any_asyncio_server(cas):
    cluster, other = cas
    server_context = cluster.server_tls(client_ca=cluster.ca).ssl_context()

    def client_context(issued) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=cluster.ca)
        if issued is not None:
            context.load_cert_chain(issued.cert, issued.key)
        return context

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readline())
        await writer.drain()
        writer.close()

    async def one(port: int, issued) -> str:
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client_context(issued), server_hostname="localhost"
            )
            writer.write(b"hello\n")
            line = await reader.readline()
            writer.close()
            return line.decode().strip() or "closed"
        except (ssl.SSLError, ConnectionError):
            return "refused"

    async def main():
        server = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=server_context)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return [await one(port, cluster.issue("web")), await one(port, None), await one(port, other.issue("x"))]

    good, anonymous, stranger = run_scenario(main(), 60)
    assert good == "hello"
    # TLS 1.3 finishes the client's handshake before the server checks its certificate: the
    # refusal then shows as the connection closing instead of a handshake error.
    assert anonymous in ("refused", "closed") and stranger in ("refused", "closed")
