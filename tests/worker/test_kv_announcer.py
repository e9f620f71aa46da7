"""KVAnnouncer: a finished prompt's KVReady goes to its decode worker once, from the engine
thread, over the cluster's mTLS when it has certificates."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.engine.output import RequestOutput
from pdserve.rpc.kv_source import PULL_MARGIN_S
from pdserve.rpc.server import RpcServer
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.worker.kv_announcer import KVAnnouncer
from tests.utils.aio import eventually, run_scenario
from tests.utils.certs import CertificateAuthority

HOLD_S = 30.0


class _DecodeWorker(worker_pb2_grpc.WorkerServicer):
    """Records the KVReady calls it gets."""

    def __init__(self) -> None:
        self.readies: list[worker_pb2.KVReadyRequest] = []

    async def KVReady(
        self, request: worker_pb2.KVReadyRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KVReadyResponse:
        self.readies.append(request)
        return worker_pb2.KVReadyResponse(accepted=True)


def _produced(request_id: str) -> RequestOutput:
    """A PRODUCER's last output: its first token (after two it resumed with) and its pinned blocks."""
    return RequestOutput(
        request_id, [9], [3, 4, 9], finished=True, finish_reason="kv_transfer", held_block_ids=[4, 5, 6]
    )


@pytest.mark.parametrize("secured", [False, True], ids=["plaintext", "mtls"])
def test_a_finished_prompt_is_announced_to_its_decode_worker_once(tmp_path, secured):
    cluster = CertificateAuthority(tmp_path, "cluster").cluster_tls("worker") if secured else None

    async def scenario() -> list[worker_pb2.KVReadyRequest]:
        decode = _DecodeWorker()
        server = RpcServer(tls=None if cluster is None else cluster.server)
        server.add(lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(decode, s), "pdserve.v1.Worker")
        endpoint = f"127.0.0.1:{await server.start('127.0.0.1', 0)}"
        announcer = KVAnnouncer("prefill-a", HOLD_S, None if cluster is None else cluster.client)
        try:
            assert announcer.expect("r1", endpoint)
            assert not announcer.expect("r1", "127.0.0.1:1")  # a repeated id: r1 still goes to its own
            announcer.expect("r2", endpoint)
            announcer.forget("r2")  # its Prefill call ended first
            for request_id in ("r1", "r2", "r3", "r1"):  # r3 has no decode call open; r1 is announced once
                await asyncio.to_thread(announcer.produced, _produced(request_id))  # as the engine thread
            deadline = asyncio.get_running_loop().time() + 10
            while not decode.readies and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # room for a second one, were it sent
            announcer.close()
            await asyncio.to_thread(announcer.produced, _produced("r1"))  # closed: nothing more goes out
            announcer.expect("r4", endpoint)
            await asyncio.to_thread(announcer.produced, _produced("r4"))
            await asyncio.sleep(0.2)
            return decode.readies
        finally:
            announcer.close()
            await server.stop(1.0)

    [ready] = run_scenario(scenario(), timeout_s=60)
    source = ready.kv_source
    assert (ready.request_id, source.worker_id, list(source.block_ids), source.first_token_id) == (
        "r1",
        "prefill-a",
        [4, 5, 6],
        9,
    )
    assert HOLD_S - PULL_MARGIN_S - 1 < source.pull_within_s <= HOLD_S - PULL_MARGIN_S


def test_announcements_go_on_after_their_decode_worker_restarts_at_the_same_endpoint():
    """The first message to a worker opens its channel; the next ones go on it from the engine
    thread. A call that finds the worker gone closes the channel, and the worker back at the
    same address gets the next message on a new one."""

    async def scenario() -> tuple[list[str], list[str]]:
        first, second = _DecodeWorker(), _DecodeWorker()
        server = RpcServer()
        server.add(lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(first, s), "pdserve.v1.Worker")
        port = await server.start("127.0.0.1", 0)
        endpoint = f"127.0.0.1:{port}"
        announcer = KVAnnouncer("prefill-a", HOLD_S, None)
        try:
            for request_id in ("r1", "r2", "r3"):
                announcer.expect(request_id, endpoint)
                await asyncio.to_thread(announcer.produced, _produced(request_id))
                await eventually(lambda: len(first.readies) == int(request_id[1]), 10, f"{request_id} announced")
            await server.stop(0)
            announcer.expect("lost", endpoint)
            await asyncio.to_thread(announcer.produced, _produced("lost"))  # UNAVAILABLE: the channel goes
            await asyncio.sleep(0.5)
            server = RpcServer()
            server.add(lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(second, s), "pdserve.v1.Worker")
            assert await server.start("127.0.0.1", port) == port
            announcer.expect("r4", endpoint)
            await asyncio.to_thread(announcer.produced, _produced("r4"))
            await eventually(lambda: len(second.readies) == 1, 10, "r4 announced to the worker back")
            return [r.request_id for r in first.readies], [r.request_id for r in second.readies]
        finally:
            announcer.close()
            await server.stop(0)

    assert run_scenario(scenario(), timeout_s=60) == (["r1", "r2", "r3"], ["r4"])
