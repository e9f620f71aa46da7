"""A prefill worker tells a request's decode worker that the KV is ready, as soon as it is.

The frontend opens the request's Decode call while the prompt computes and names that decode
worker in the Prefill call (``kv_consumer``). The moment the engine samples the prompt's first
token, on the engine thread and before the output reaches the event loop, ``KVAnnouncer``
hands the message to a sender thread of its own, which sends ``KVReady`` over a blocking gRPC
channel without waiting for the answer. The engine thread itself only queues: no gRPC call,
channel or lock of gRPC's is ever on its path. (Sent from the engine thread itself, the message
reached the decode worker before the Prefill handler ran; from this thread it takes 2.4 ms at
the median on 2 CPUs, about what the event loop took.)

Best effort, once: the frontend sends the same ``KVReady`` if the decode worker has not
reported the pull soon after the Prefill call returned.
"""

from __future__ import annotations

import logging
import queue
import threading

import grpc

from pdserve.engine.engine import RequestOutput
from pdserve.rpc.kv_source import ready_source
from pdserve.rpc.server import CHANNEL_OPTIONS
from pdserve.rpc.tls import ClientTLS
from pdserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

_STOP = None  # the sender thread's last item
_JOIN_S = 5.0  # close() waits this long for the sender thread


class KVAnnouncer:
    """Announces this worker's (``worker_id``) finished prompts to their decode workers.

    ``hold_s``: how long the prompt's blocks stay pinned (the pull window, less the margin);
    ``tls``: the cluster's client side, or None for plaintext; ``timeout_s`` bounds each call.
    """

    def __init__(self, worker_id: str, hold_s: float, tls: ClientTLS | None, timeout_s: float = 5.0) -> None:
        self.worker_id = worker_id
        self.hold_s = hold_s
        self.tls = tls
        self.timeout_s = timeout_s
        self._consumers: dict[str, str] = {}  # request id -> its decode worker's endpoint
        self._outbox: queue.SimpleQueue[tuple[str, worker_pb2.KVReadyRequest] | None] = queue.SimpleQueue()
        # The sender thread's own: the channels, and the calls until answered (a dropped one may be cancelled).
        self._channels: dict[str, grpc.Channel] = {}
        self._calls: set[grpc.Future] = set()
        self._unreachable: queue.SimpleQueue[str] = queue.SimpleQueue()  # endpoints whose call failed UNAVAILABLE
        self._sender = threading.Thread(target=self._send_all, name=f"kv-announcer-{worker_id}", daemon=True)
        self._sender.start()

    def expect(self, request_id: str, endpoint: str) -> None:
        """``request_id``'s KV goes to the decode worker at ``endpoint`` (before the engine has it)."""
        self._consumers[request_id] = endpoint

    def forget(self, request_id: str) -> None:
        """The Prefill call is over: nothing left to announce for it."""
        self._consumers.pop(request_id, None)

    def produced(self, output: RequestOutput) -> None:
        """Engine thread: a PRODUCER's prompt is done (``EngineLoop.on_produced``). Only queues."""
        endpoint = self._consumers.pop(output.request_id, None)
        if endpoint is None or output.held_block_ids is None:
            return
        source = ready_source(self.worker_id, output.held_block_ids, output.token_ids[-1], self.hold_s)
        self._outbox.put((endpoint, worker_pb2.KVReadyRequest(request_id=output.request_id, kv_source=source)))

    def close(self) -> None:
        """Stop the sender thread (within ``_JOIN_S``); later prompts are not announced."""
        self._outbox.put(_STOP)
        self._sender.join(_JOIN_S)
        if self._sender.is_alive():
            logger.warning("the KV announcer's sender did not stop within %.0f s", _JOIN_S)

    def _send_all(self) -> None:
        try:
            while (item := self._outbox.get()) is not _STOP:
                self._drop_unreachable()
                endpoint, message = item
                try:
                    call = self._stub(endpoint).KVReady.future(message, timeout=self.timeout_s)
                except Exception:  # a bad endpoint, a closed channel: the frontend's KVReady covers it
                    logger.exception("KVReady of %s to %s not sent", message.request_id, endpoint)
                    continue
                self._calls.add(call)
                call.add_done_callback(lambda done, rid=message.request_id, at=endpoint: self._answered(done, rid, at))
        finally:
            for call in list(self._calls):
                call.cancel()
            for channel in self._channels.values():
                channel.close()

    def _stub(self, endpoint: str) -> worker_pb2_grpc.WorkerStub:
        channel = self._channels.get(endpoint)
        if channel is None:
            options = list(CHANNEL_OPTIONS)
            if self.tls is None:
                channel = grpc.insecure_channel(endpoint, options=options)
            else:
                channel = grpc.secure_channel(endpoint, self.tls.grpc_credentials(), options + self.tls.grpc_options())
            self._channels[endpoint] = channel
        return worker_pb2_grpc.WorkerStub(channel)

    def _drop_unreachable(self) -> None:
        """Close the channels of workers that could not be reached: most likely gone."""
        while True:
            try:
                endpoint = self._unreachable.get_nowait()
            except queue.Empty:
                return
            channel = self._channels.pop(endpoint, None)
            if channel is not None:
                channel.close()

    def _answered(self, call: grpc.Future, request_id: str, endpoint: str) -> None:
        """On a gRPC thread: let the call go; a failure is the frontend's KVReady to cover."""
        self._calls.discard(call)
        if call.cancelled():
            return
        error = call.exception()
        if isinstance(error, grpc.RpcError):
            logger.info("KVReady of %s to %s: %s %s", request_id, endpoint, error.code().name, error.details())
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                self._unreachable.put(endpoint)
