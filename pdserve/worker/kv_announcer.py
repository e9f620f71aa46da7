"""A prefill worker tells a request's decode worker that the KV is ready, from the engine thread.

The frontend opens the request's Decode call while the prompt computes and names that decode
worker in the Prefill call (``kv_consumer``). The moment the engine samples the prompt's first
token, on the engine thread and before the output reaches the event loop, ``KVAnnouncer``
sends the decode worker ``KVReady`` over a blocking gRPC channel without waiting for the
answer. The event loop would be later: while the engine computes the next prompt it gets the
GIL only now and then, and the message went out 2–3 ms after the token on 2 CPUs. From the
engine thread it reaches the decode worker before the Prefill call has returned.

Best effort, once: the frontend sends the same ``KVReady`` if the decode worker has not
reported the pull soon after the Prefill call returned.
"""

from __future__ import annotations

import logging
import threading

import grpc

from pdserve.engine.engine import RequestOutput
from pdserve.rpc.kv_source import ready_source
from pdserve.rpc.server import CHANNEL_OPTIONS
from pdserve.rpc.tls import ClientTLS
from pdserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


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
        self._lock = threading.Lock()  # the channels and _closed: engine thread and event loop
        self._channels: dict[str, grpc.Channel] = {}
        self._unreachable: list[grpc.Channel] = []  # to close (not from a gRPC callback, which runs on it)
        self._calls: set[grpc.Future] = set()  # referenced until answered: a dropped call may be cancelled
        self._closed = False

    def expect(self, request_id: str, endpoint: str) -> None:
        """``request_id``'s KV goes to the decode worker at ``endpoint`` (before the engine has it)."""
        self._consumers[request_id] = endpoint

    def forget(self, request_id: str) -> None:
        """The Prefill call is over: nothing left to announce for it."""
        self._consumers.pop(request_id, None)

    def produced(self, output: RequestOutput) -> None:
        """Engine thread: a PRODUCER's prompt is done (``EngineLoop.on_produced``). Never blocks."""
        endpoint = self._consumers.pop(output.request_id, None)
        if endpoint is None or output.held_block_ids is None:
            return
        source = ready_source(self.worker_id, output.held_block_ids, output.token_ids[-1], self.hold_s)
        message = worker_pb2.KVReadyRequest(request_id=output.request_id, kv_source=source)
        with self._lock:
            if self._closed:
                return
            unreachable, self._unreachable = self._unreachable, []
            call = self._stub(endpoint).KVReady.future(message, timeout=self.timeout_s)
            self._calls.add(call)
        for channel in unreachable:
            channel.close()
        call.add_done_callback(lambda done: self._answered(done, output.request_id, endpoint))

    def close(self) -> None:
        """Cancel what is unanswered and close the channels; later prompts are not announced."""
        with self._lock:
            self._closed = True
            calls, self._calls = list(self._calls), set()
            channels, self._channels = [*self._channels.values(), *self._unreachable], {}
            self._unreachable = []
        for call in calls:
            call.cancel()
        for channel in channels:
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

    def _answered(self, call: grpc.Future, request_id: str, endpoint: str) -> None:
        """On a gRPC thread: let the call go; a failure is the frontend's KVReady to cover.
        A worker that cannot be reached is most likely gone: its channel is not kept."""
        error = None if call.cancelled() else call.exception()
        with self._lock:
            self._calls.discard(call)
            if isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE:
                channel = self._channels.pop(endpoint, None)
                if channel is not None:
                    self._unreachable.append(channel)
        if isinstance(error, grpc.RpcError):
            logger.info("KVReady of %s to %s: %s %s", request_id, endpoint, error.code().name, error.details())
