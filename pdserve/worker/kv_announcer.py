"""A prefill worker tells a request's decode worker that the KV is ready, as soon as it is.

The frontend opens the request's Decode call while the prompt computes and names that decode
worker in the Prefill call (``kv_consumer``). The moment the engine samples the prompt's first
token, on the engine thread and before the output reaches the event loop, ``KVAnnouncer``
sends ``KVReady`` over a blocking gRPC channel without waiting for the answer.

The engine thread sends only on a channel that is open already: starting a call on one is a
few hundred microseconds and never blocks (a call to an unreachable worker fails on its own,
later). Opening a channel, and closing that of a worker that could not be reached, is the
work of a sender thread of the announcer's own, which also sends each worker's first
message. (With every message handed to that thread, the median message reached the decode
worker 2.4 ms after the Prefill handler had the output, on 2 busy CPUs: the thread waits for
a core and the GIL while the engine computes. Sent from the engine thread, 0.4 ms before.)

Best effort, once: the frontend sends the same ``KVReady`` if the decode worker has not
reported the pull soon after the Prefill call returned.
"""

from __future__ import annotations

import logging
import queue
import threading

import grpc

from pdserve.engine.output import RequestOutput
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
        # Messages for the sender thread, and (endpoint, None): close that worker's channel.
        self._outbox: queue.SimpleQueue[tuple[str, worker_pb2.KVReadyRequest | None] | None] = queue.SimpleQueue()
        # Only the sender thread adds or removes channels; a call starts on one only under the lock, and one
        # leaves the table under it before it is closed: closing a channel a call is starting on crashes the process.
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._closed = False
        self._calls: set[grpc.Future] = set()  # until answered: a dropped call may be cancelled
        self._sender = threading.Thread(target=self._send_all, name=f"kv-announcer-{worker_id}", daemon=True)
        self._sender.start()

    def expect(self, request_id: str, endpoint: str) -> bool:
        """``request_id``'s KV goes to the decode worker at ``endpoint`` (before the engine has it);
        False, and nothing changed, when a call in flight already expects it under that id."""
        if request_id in self._consumers:
            return False
        self._consumers[request_id] = endpoint
        return True

    def forget(self, request_id: str) -> None:
        """The Prefill call is over: nothing left to announce for it."""
        self._consumers.pop(request_id, None)

    def produced(self, output: RequestOutput) -> None:
        """Engine thread: a PRODUCER's prompt is done (``EngineLoop.on_produced``). Sends on
        an open channel, else queues for the sender thread; never blocks."""
        endpoint = self._consumers.pop(output.request_id, None)
        if endpoint is None or output.held_block_ids is None:
            return
        source = ready_source(self.worker_id, output.held_block_ids, output.token_ids[-1], self.hold_s)
        message = worker_pb2.KVReadyRequest(request_id=output.request_id, kv_source=source)
        with self._lock:
            channel = self._channels.get(endpoint)
            if channel is not None and not self._closed:
                self._send(channel, endpoint, message)
                return
        self._outbox.put((endpoint, message))

    def close(self) -> None:
        """Stop the sender thread (within ``_JOIN_S``); later prompts are not announced."""
        with self._lock:
            self._closed = True
        self._outbox.put(_STOP)
        self._sender.join(_JOIN_S)
        if self._sender.is_alive():
            logger.warning("the KV announcer's sender did not stop within %.0f s", _JOIN_S)

    def _send(self, channel: grpc.Channel, endpoint: str, message: worker_pb2.KVReadyRequest) -> None:
        """Start the call without waiting for it (under the lock)."""
        call = worker_pb2_grpc.WorkerStub(channel).KVReady.future(message, timeout=self.timeout_s)
        self._calls.add(call)
        call.add_done_callback(lambda done, rid=message.request_id: self._answered(done, rid, endpoint))

    def _send_all(self) -> None:
        try:
            while (item := self._outbox.get()) is not _STOP:
                endpoint, message = item
                if message is None:
                    self._close_channel(endpoint)
                    continue
                opened = None
                if endpoint not in self._channels:  # opened outside the lock: reading certificates takes a while
                    try:
                        opened = self._open(endpoint)
                    except Exception:  # a bad endpoint: the frontend's KVReady covers it
                        logger.exception("KVReady of %s to %s not sent", message.request_id, endpoint)
                        continue
                with self._lock:  # only this thread adds or removes channels
                    if opened is not None:
                        self._channels[endpoint] = opened
                    if not self._closed:
                        self._send(self._channels[endpoint], endpoint, message)
        finally:
            with self._lock:
                self._closed = True
                channels, self._channels = list(self._channels.values()), {}
            for call in list(self._calls):
                call.cancel()
            for channel in channels:
                channel.close()

    def _open(self, endpoint: str) -> grpc.Channel:
        options = list(CHANNEL_OPTIONS)
        if self.tls is None:
            return grpc.insecure_channel(endpoint, options=options)
        return grpc.secure_channel(endpoint, self.tls.grpc_credentials(), options + self.tls.grpc_options())

    def _close_channel(self, endpoint: str) -> None:
        """Close the channel of a worker that could not be reached: most likely gone. The next
        message for it opens a new one."""
        with self._lock:
            channel = self._channels.pop(endpoint, None)
        if channel is not None:  # no longer in the table: nobody else can start a call on it
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
                self._outbox.put((endpoint, None))
