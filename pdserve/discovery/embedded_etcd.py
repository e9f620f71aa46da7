"""An in-process, in-memory stand-in for a single etcd node, for one-machine ``pdserve up``.

``pdserve up`` must work with nothing installed, so when no ``--etcd`` is given it serves
this: a gRPC server speaking the etcd v3 API with aetcd's own protobuf messages, so that the
very client code that talks to a real etcd talks to it unchanged. It implements exactly
what pdserve uses:

- KV.Range (one key, a ``range_end`` range or prefix, ``limit``, ``keys_only``,
  ``count_only``), KV.Put (with a lease, ``prev_kv``), KV.DeleteRange (``prev_kv``);
- Lease.LeaseGrant, LeaseRevoke, LeaseKeepAlive (a bidirectional stream), LeaseTimeToLive.

Everything else (Txn, Compact, Watch, Cluster, Maintenance, Auth, and request options such
as sorting or historical revisions) answers UNIMPLEMENTED rather than something subtly
different. Leases expire exactly: every request first deletes the keys of leases past their
deadline, so no client can ever observe an expired key. Revisions advance as etcd's do (one
per write that changed something) and are reported in every response header.

No persistence, no auth, no watch, one node: a restart forgets everything, and workers
re-register under new leases (see WorkerRegistration). Use a real etcd in production. Given
TLS settings it serves TLS, and with their client CA only to clients with a certificate that
CA signed (``pdserve up`` with the cluster's certificates serves it so).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from aetcd.rpc import kv_pb2, rpc_pb2, rpc_pb2_grpc

from pdserve.rpc.tls import ServerTLS

# Fixed identities: clients only compare them between responses.
_CLUSTER_ID = 0x70D5E7E
_MEMBER_ID = 0x1


@dataclass
class _Lease:
    ttl: int
    expires_at: float  # time.monotonic()
    keys: set[bytes] = field(default_factory=set)


class _Store:
    """The key space and its leases: plain bookkeeping, no I/O, no awaits (so no locks)."""

    def __init__(self) -> None:
        self.revision = 1  # etcd's first revision on an empty cluster
        self._kvs: dict[bytes, kv_pb2.KeyValue] = {}
        self._sorted_keys: list[bytes] = []
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(0x50D5E70000000001)

    def header(self) -> rpc_pb2.ResponseHeader:
        return rpc_pb2.ResponseHeader(
            cluster_id=_CLUSTER_ID,
            member_id=_MEMBER_ID,
            revision=self.revision,
            raft_term=1,
        )

    def expire_leases(self) -> None:
        now = time.monotonic()
        for lease_id in [i for i, lease in self._leases.items() if lease.expires_at <= now]:
            self.revoke(lease_id)

    def keys_in(self, key: bytes, range_end: bytes) -> list[bytes]:
        """Keys as etcd's Range selects them: one key, [key, range_end), or all from key on."""
        if not range_end:
            return [key] if key in self._kvs else []
        start = bisect.bisect_left(self._sorted_keys, key)
        if range_end == b"\0":  # etcd's "every key >= key"
            return self._sorted_keys[start:]
        return self._sorted_keys[start : bisect.bisect_left(self._sorted_keys, range_end)]

    def get(self, key: bytes) -> kv_pb2.KeyValue:
        return self._kvs[key]

    def put(self, key: bytes, value: bytes, lease_id: int) -> kv_pb2.KeyValue | None:
        """Write one key; returns the previous value. The lease must exist (check first)."""
        previous = self._kvs.get(key)
        self.revision += 1
        if previous is None:
            bisect.insort(self._sorted_keys, key)
        elif previous.lease:
            self._leases[previous.lease].keys.discard(key)
        self._kvs[key] = kv_pb2.KeyValue(
            key=key,
            value=value,
            create_revision=previous.create_revision if previous else self.revision,
            mod_revision=self.revision,
            version=previous.version + 1 if previous else 1,
            lease=lease_id,
        )
        if lease_id:
            self._leases[lease_id].keys.add(key)
        return previous

    def delete(self, keys: list[bytes]) -> list[kv_pb2.KeyValue]:
        """Delete keys (all in one revision); returns what they held."""
        if not keys:
            return []
        self.revision += 1
        deleted = []
        for key in keys:
            kv = self._kvs.pop(key)
            self._sorted_keys.pop(bisect.bisect_left(self._sorted_keys, key))
            if kv.lease in self._leases:
                self._leases[kv.lease].keys.discard(key)
            deleted.append(kv)
        return deleted

    def grant(self, ttl: int, lease_id: int) -> int:
        if lease_id == 0:
            lease_id = next(self._lease_ids)
        self._leases[lease_id] = _Lease(ttl=ttl, expires_at=time.monotonic() + ttl)
        return lease_id

    def lease(self, lease_id: int) -> _Lease | None:
        return self._leases.get(lease_id)

    def renew(self, lease_id: int) -> int:
        """Restart a lease's clock; returns its TTL, 0 for a lease it does not have (as etcd)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return 0
        lease.expires_at = time.monotonic() + lease.ttl
        return lease.ttl

    def revoke(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        self.delete(sorted(lease.keys))


_LEASE_NOT_FOUND = "etcdserver: requested lease not found"  # etcd's words, which aetcd surfaces


async def _unimplemented(context: grpc.aio.ServicerContext, what: str) -> None:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"the embedded etcd does not implement {what}")


class _KVService(rpc_pb2_grpc.KVServicer):
    def __init__(self, store: _Store) -> None:
        self._store = store

    async def Range(self, request: rpc_pb2.RangeRequest, context: grpc.aio.ServicerContext) -> rpc_pb2.RangeResponse:
        unsupported = (
            request.revision
            or request.sort_order != rpc_pb2.RangeRequest.NONE
            or request.min_mod_revision
            or request.max_mod_revision
            or request.min_create_revision
            or request.max_create_revision
        )
        if unsupported:
            await _unimplemented(context, "Range sorting, revisions or revision filters")
        store = self._store
        store.expire_leases()
        keys = store.keys_in(request.key, request.range_end)
        response = rpc_pb2.RangeResponse(header=store.header(), count=len(keys))
        if request.count_only:
            return response
        if request.limit and len(keys) > request.limit:
            keys, response.more = keys[: request.limit], True
        for key in keys:
            kv = response.kvs.add()
            kv.CopyFrom(store.get(key))
            if request.keys_only:
                kv.ClearField("value")
        return response

    async def Put(self, request: rpc_pb2.PutRequest, context: grpc.aio.ServicerContext) -> rpc_pb2.PutResponse:
        if request.ignore_value or request.ignore_lease:
            await _unimplemented(context, "Put ignore_value or ignore_lease")
        if not request.key:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: key is not provided")
        store = self._store
        store.expire_leases()
        if request.lease and store.lease(request.lease) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, _LEASE_NOT_FOUND)
        previous = store.put(request.key, request.value, request.lease)
        response = rpc_pb2.PutResponse(header=store.header())
        if request.prev_kv and previous is not None:
            response.prev_kv.CopyFrom(previous)
        return response

    async def DeleteRange(
        self, request: rpc_pb2.DeleteRangeRequest, context: grpc.aio.ServicerContext
    ) -> rpc_pb2.DeleteRangeResponse:
        store = self._store
        store.expire_leases()
        deleted = store.delete(store.keys_in(request.key, request.range_end))
        response = rpc_pb2.DeleteRangeResponse(header=store.header(), deleted=len(deleted))
        if request.prev_kv:
            response.prev_kvs.extend(deleted)
        return response

    async def Txn(self, request: rpc_pb2.TxnRequest, context: grpc.aio.ServicerContext) -> None:
        await _unimplemented(context, "Txn")

    async def Compact(self, request: rpc_pb2.CompactionRequest, context: grpc.aio.ServicerContext) -> None:
        await _unimplemented(context, "Compact")


class _LeaseService(rpc_pb2_grpc.LeaseServicer):
    def __init__(self, store: _Store) -> None:
        self._store = store

    async def LeaseGrant(
        self, request: rpc_pb2.LeaseGrantRequest, context: grpc.aio.ServicerContext
    ) -> rpc_pb2.LeaseGrantResponse:
        store = self._store
        store.expire_leases()
        if request.ID and store.lease(request.ID) is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: lease already exists")
        ttl = max(1, request.TTL)
        lease_id = store.grant(ttl, request.ID)
        return rpc_pb2.LeaseGrantResponse(header=store.header(), ID=lease_id, TTL=ttl)

    async def LeaseRevoke(
        self, request: rpc_pb2.LeaseRevokeRequest, context: grpc.aio.ServicerContext
    ) -> rpc_pb2.LeaseRevokeResponse:
        store = self._store
        store.expire_leases()
        if store.lease(request.ID) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, _LEASE_NOT_FOUND)
        store.revoke(request.ID)
        return rpc_pb2.LeaseRevokeResponse(header=store.header())

    async def LeaseKeepAlive(
        self,
        request_iterator: AsyncIterator[rpc_pb2.LeaseKeepAliveRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[rpc_pb2.LeaseKeepAliveResponse]:
        store = self._store
        async for request in request_iterator:
            store.expire_leases()
            ttl = store.renew(request.ID)
            yield rpc_pb2.LeaseKeepAliveResponse(header=store.header(), ID=request.ID, TTL=ttl)

    async def LeaseTimeToLive(
        self, request: rpc_pb2.LeaseTimeToLiveRequest, context: grpc.aio.ServicerContext
    ) -> rpc_pb2.LeaseTimeToLiveResponse:
        store = self._store
        store.expire_leases()
        lease = store.lease(request.ID)
        response = rpc_pb2.LeaseTimeToLiveResponse(header=store.header(), ID=request.ID, TTL=-1)
        if lease is None:  # etcd answers an unknown lease with TTL -1, not an error
            return response
        response.TTL = max(0, math.ceil(lease.expires_at - time.monotonic()))
        response.grantedTTL = lease.ttl
        if request.keys:
            response.keys.extend(sorted(lease.keys))
        return response

    async def LeaseLeases(self, request: rpc_pb2.LeaseLeasesRequest, context: grpc.aio.ServicerContext) -> None:
        await _unimplemented(context, "LeaseLeases")


class EmbeddedEtcd:
    """The stand-in etcd, served on one port of this process's event loop."""

    def __init__(self) -> None:
        self._server: grpc.aio.Server | None = None
        self.url: str | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0, tls: ServerTLS | None = None) -> str:
        """Serve on ``host:port`` (0: a free port), over TLS with ``tls``; returns the URL
        clients connect to (``https://`` with TLS)."""
        if self._server is not None:
            raise RuntimeError(f"the embedded etcd already serves {self.url}")
        store = _Store()
        server = grpc.aio.server()
        rpc_pb2_grpc.add_KVServicer_to_server(_KVService(store), server)
        rpc_pb2_grpc.add_LeaseServicer_to_server(_LeaseService(store), server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, tls.grpc_credentials())
        await server.start()
        self._server = server
        scheme = "http" if tls is None else "https"
        self.url = f"{scheme}://[{host}]:{bound}" if ":" in host else f"{scheme}://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        """Stop serving at once; open calls fail, and every key and lease is forgotten."""
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace=None)


async def _serve(host: str, port: int) -> None:
    etcd = EmbeddedEtcd()
    print(await etcd.start(host, port), flush=True)
    try:
        await asyncio.Event().wait()  # until interrupted
    finally:
        await etcd.stop()


def main() -> None:
    """``python -m pdserve.discovery.embedded_etcd --port P``: serve and print the URL."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    args = parser.parse_args()
    try:
        asyncio.run(_serve(args.host, args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
