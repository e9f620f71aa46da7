"""``pdserve workers`` and ``pdserve drain``, and what every operator command shares:
the ``--etcd`` option, one connection under a deadline, error reporting, tables and units.

Exit status of the operator commands (``slo``, ``status``, ``workers``, ``drain``): 0 on
success; 1 when etcd is unreachable or the operation failed (an unknown worker, a failed
RPC, a stored value that does not decode); 2 for bad arguments (argparse's own code).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aetcd
import grpc
import msgspec

from pdserve import environment
from pdserve.cli.secrets import add_secret_option, secret
from pdserve.cli.local_deployment import use_local_deployment
from pdserve.cli.common import add_cluster_tls_args, add_etcd_auth_args, cluster_tls, etcd_auth, positive_duration
from pdserve.discovery.etcd import ETCD_ERRORS, RegistryUnavailable, close_quietly, connect, describe_etcd_error
from pdserve.discovery.registry import WORKERS_PREFIX, Role, WorkerEntry, decode_entries, decode_entry, worker_key
from pdserve.rpc.admin import admin_metadata
from pdserve.rpc.tls import ClusterTLS, secure_or_insecure_channel
from pdserve.v1 import worker_pb2, worker_pb2_grpc

# Deadline of the connection probe and of each etcd call: with Python's start-up, an
# unreachable etcd fails a command in a few seconds.
ETCD_TIMEOUT_S = 2.0

EXIT_STATUS = """exit status: 0 success; 1 etcd unreachable or the operation failed; 2 bad arguments.
etcd: --etcd URL or $PDSERVE_ETCD, e.g. http://127.0.0.1:2379, else the registry of the `pdserve up`
running on this machine, with its credentials (its record in $PDSERVE_STATE_DIR); an etcd with TLS
or auth takes https:// and the --etcd-* options below (README: Security lists the etcd roles each
needs)."""

WORKERS_EXAMPLES = f"""examples:
  pdserve workers --etcd http://127.0.0.1:2379
  PDSERVE_ETCD=http://etcd:2379 pdserve workers --model meta-llama/Llama-3.1-8B
  pdserve workers --json | jq '.[] | select(.draining) | .worker_id'

columns: RUN/WAIT requests running and queued; KV the share of KV blocks in use; HELD prompts
whose KV a prefill worker keeps pinned for a decode worker to pull; UP time since the worker
started; LEASE seconds left of its etcd lease / its TTL (a live worker renews it every second);
GROUP, for a rank of a data-parallel group, the group (rank 0's id) [this rank/its ranks].

{EXIT_STATUS}
"""

DRAIN_EXAMPLES = f"""examples:
  pdserve drain decode-node3-4711
  pdserve drain prefill-node1-1234 --wait --timeout 120s
  pdserve drain --endpoint 127.0.0.1:50051 --wait --timeout 90s   # from inside the worker's pod (preStop)

The worker stops taking requests, finishes those in flight (bounded by its --drain-timeout),
leaves the registry and exits. Routers stop sending it work as soon as it reports draining.

A secured worker drains only for a caller with a cluster certificate (when the cluster runs
mTLS: --cluster-ca/--cluster-cert/--cluster-key; one naming pdserve-tools or pdserve-operator,
or no pdserve component) or its admin key (--admin-key, or $PDSERVE_ADMIN_KEY); others get
UNAUTHENTICATED or PERMISSION_DENIED. Without --cluster-*, drain uses the tools' certificate of
the `pdserve up` running on this machine.

{EXIT_STATUS}
"""


class OperationFailed(Exception):
    """The command ran but could not do what was asked; printed as one line, exit status 1."""


def add_etcd_arg(parser: argparse.ArgumentParser) -> None:
    """``--etcd`` and etcd's TLS and auth options (``cli.common.etcd_auth`` reads them)."""
    parser.add_argument(
        "--etcd",
        default=environment.etcd_url(),
        metavar="URL",
        help="etcd URL, e.g. http://127.0.0.1:2379 or https:// for TLS (default: $PDSERVE_ETCD, else the "
        "registry of the `pdserve up` running on this machine)",
    )
    add_etcd_auth_args(parser)


def run_with_etcd(args: argparse.Namespace, body: Callable[[aetcd.Client], Awaitable[int]]) -> int:
    """Connect to ``args.etcd`` under a deadline, run ``body(client)``, close; report failures.

    A missing ``--etcd`` is a ValueError (exit 2, through ``cli.main``); an unreachable etcd,
    an etcd call past its deadline and ``OperationFailed`` print one line and return 1.
    """
    use_local_deployment(args)
    if not args.etcd:
        raise ValueError(
            "--etcd is required (or set PDSERVE_ETCD), e.g. --etcd http://127.0.0.1:2379; "
            f"no `pdserve up` runs beside this command (none recorded in {environment.state_dir()})"
        )

    auth = etcd_auth(args)

    async def main() -> int:
        client = await connect(args.etcd, ETCD_TIMEOUT_S, auth)
        try:
            return await body(client)
        finally:
            await close_quietly(client)

    try:
        return asyncio.run(main())
    except OperationFailed as error:
        return fail(args, str(error))
    except ETCD_ERRORS + (RegistryUnavailable,) as error:
        return fail(args, unreachable(args.etcd, error))


def unreachable(url: str, error: Exception) -> str:
    """``etcd at URL is unreachable: why`` (or refused the credentials, or TLS failed), for a
    failed connection or a failed call."""
    if isinstance(error, RegistryUnavailable):  # connect() has said it in these words
        return str(error)
    if not str(error):
        return f"etcd at {url} is unreachable: no answer within {ETCD_TIMEOUT_S:g} s"
    return describe_etcd_error(url, error)


def fail(args: argparse.Namespace, message: str) -> int:
    print(f"pdserve {args.command}: error: {message}", file=sys.stderr)
    return 1


def print_json(value: Any, *, compact: bool = False) -> None:
    print(json.dumps(value, separators=(",", ":")) if compact else json.dumps(value, indent=2))


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "") -> str:
    """Left-aligned columns two spaces apart; None prints as ``-``."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def fmt_seconds(seconds: float | None) -> str:
    """``0.5`` → ``500ms``, ``0.0305`` → ``30.5ms``, ``2.25`` → ``2.25s``; None → ``-``."""
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.4g}ms" if seconds < 1 else f"{seconds:.4g}s"


def fmt_ms(ms: float | None) -> str:
    """A measured latency: ``123ms``, ``8.5ms``, ``2.10s``; None → ``-``."""
    if ms is None:
        return "-"
    if ms >= 1000:
        return f"{ms / 1e3:.2f}s"
    return f"{ms:.0f}ms" if ms >= 10 else f"{ms:.1f}ms"


def fmt_age(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``2h07m``, ``3d04h``; None → ``-``."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


async def read_workers(client: aetcd.Client) -> list[tuple[WorkerEntry, int]]:
    """Every registered worker with the id of the lease its entry lives under (0: none),
    sorted by model, role (prefill first) and id."""
    async with asyncio.timeout(ETCD_TIMEOUT_S):
        response = await client.get_prefix(WORKERS_PREFIX.encode())
    warned: set[tuple[bytes, int]] = set()
    workers = [(entry, kv.lease) for kv in response for entry in decode_entries([kv], warned)]
    return sorted(workers, key=lambda w: (w[0].model, list(Role).index(w[0].role), w[0].worker_id))


async def lease_ttls(client: aetcd.Client, lease_ids: set[int]) -> dict[int, tuple[int, int]]:
    """``lease id → (seconds left, granted TTL)`` for the leases etcd still has; best effort."""
    ids = sorted(i for i in lease_ids if i)

    async def one(lease_id: int) -> Any:
        async with asyncio.timeout(ETCD_TIMEOUT_S):
            return await client.get_lease_info(lease_id, keys=False)

    replies = await asyncio.gather(*(one(i) for i in ids), return_exceptions=True)
    return {i: (r.TTL, r.grantedTTL) for i, r in zip(ids, replies) if not isinstance(r, BaseException) and r.TTL >= 0}


def worker_json(entry: WorkerEntry, lease_id: int, ttl: tuple[int, int] | None, now: float) -> dict[str, Any]:
    """A worker as ``workers --json`` prints it: the entry (less the NIXL blob) and its lease."""
    value = msgspec.to_builtins(entry)
    del value["nixl"]
    value["load"]["kv_usage"] = entry.load.kv_usage
    value["uptime_s"] = now - entry.started_at
    value["lease_id"] = f"{lease_id:x}" if lease_id else None
    value["lease_ttl_s"], value["lease_granted_ttl_s"] = ttl if ttl else (None, None)
    return value


def add_parser(commands: argparse._SubParsersAction) -> None:
    workers = commands.add_parser(
        "workers",
        help="list registered workers: role, address, model, load, lease",
        description="List every worker registered in etcd with its role, gRPC endpoint, model, load and lease.",
        epilog=WORKERS_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_etcd_arg(workers)
    workers.add_argument("--model", help="only this model's workers")
    workers.add_argument("--json", action="store_true", help="print a JSON list (one object per worker)")
    workers.set_defaults(func=run_workers)

    drain = commands.add_parser(
        "drain",
        help="drain a worker: it finishes its requests, then exits",
        description="Ask a worker, through its Drain RPC, to stop taking work, finish what\n"
        "is in flight, leave the registry and exit.",
        epilog=DRAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_etcd_arg(drain)
    target = drain.add_mutually_exclusive_group(required=True)
    target.add_argument("worker", metavar="WORKER", nargs="?", help="worker id, as `pdserve workers` lists it")
    target.add_argument(
        "--endpoint",
        metavar="HOST:PORT",
        help="the worker's gRPC address instead of its id (no etcd needed): a pod's preStop hook "
        "drains its own worker at 127.0.0.1:PORT",
    )
    drain.add_argument(
        "--wait",
        action="store_true",
        help="wait until the worker has left the registry (with --endpoint: until it has no "
        "request in flight, or has stopped serving)",
    )
    drain.add_argument(
        "--timeout", type=positive_duration, default=60.0, help="with --wait: the longest wait, e.g. 90s (default: 60s)"
    )
    drain.add_argument("--json", action="store_true", help="print the outcome as JSON")
    add_secret_option(drain, "--admin-key", env="PDSERVE_ADMIN_KEY", help="the workers' admin key")
    add_cluster_tls_args(drain, "the Drain RPC is made over mTLS with this cluster certificate")
    drain.set_defaults(func=run_drain)


def run_workers(args: argparse.Namespace) -> int:
    async def body(client: aetcd.Client) -> int:
        workers = [(e, lease) for e, lease in await read_workers(client) if args.model in (None, e.model)]
        ttls = await lease_ttls(client, {lease for _, lease in workers})
        now = time.time()
        if args.json:
            print_json([worker_json(e, lease, ttls.get(lease), now) for e, lease in workers])
            return 0
        if not workers:
            where = f" for model {args.model!r}" if args.model else ""
            print(f"no workers registered{where} in etcd at {args.etcd}")
            return 0
        rows = []
        for e, lease in workers:
            ttl = ttls.get(lease)
            rows.append(
                [
                    e.role,
                    e.worker_id,
                    e.endpoint,
                    e.model,
                    e.load.running,
                    e.load.waiting,
                    f"{e.load.kv_usage:.0%}",
                    e.load.held_requests if e.role is Role.PREFILL else None,
                    "draining" if e.draining else "ready",
                    fmt_age(now - e.started_at),
                    f"{ttl[0]}s/{ttl[1]}s" if ttl else None,
                    f"{e.group_id}[{e.group_rank}/{e.group_size}]" if e.group_id else None,
                ]
            )
        headers = ["ROLE", "WORKER", "ENDPOINT", "MODEL", "RUN", "WAIT", "KV", "HELD", "STATE", "UP", "LEASE", "GROUP"]
        print(table(headers, rows))
        return 0

    return run_with_etcd(args, body)


def run_drain(args: argparse.Namespace) -> int:
    use_local_deployment(args, cluster=True)
    cluster = cluster_tls(args)
    metadata = admin_metadata(secret(args, "admin_key", environment.admin_key()))
    if args.endpoint:
        return _drain_endpoint(args, cluster, metadata)

    async def body(client: aetcd.Client) -> int:
        workers = [e for e, _ in await read_workers(client)]
        matches = [e for e in workers if e.worker_id == args.worker]
        if not matches:
            known = ", ".join(sorted({e.worker_id for e in workers})) or "none are registered"
            raise OperationFailed(f"no worker {args.worker!r} in the registry at {args.etcd}; known workers: {known}")
        if len(matches) > 1:
            places = ", ".join(f"{e.model}/{e.role} at {e.endpoint}" for e in matches)
            raise OperationFailed(f"worker id {args.worker!r} is registered more than once ({places})")
        entry = matches[0]
        async with secure_or_insecure_channel(entry.endpoint, None if cluster is None else cluster.client) as channel:
            try:
                reply = await worker_pb2_grpc.WorkerStub(channel).Drain(
                    worker_pb2.DrainRequest(), metadata=metadata, timeout=5.0
                )
            except grpc.aio.AioRpcError as error:
                hint = ""
                if error.code() == grpc.StatusCode.UNAVAILABLE and cluster is None:
                    hint = " (a worker serving the cluster's mTLS needs --cluster-ca, --cluster-cert and --cluster-key)"
                raise OperationFailed(
                    f"Drain RPC to {entry.worker_id} at {entry.endpoint} failed: "
                    f"{error.code().name}: {error.details()}{hint}"
                ) from None
        left = await _wait_gone(client, entry, args.timeout) if args.wait else None
        if args.json:
            print_json(
                {
                    "worker_id": entry.worker_id,
                    "role": entry.role,
                    "model": entry.model,
                    "endpoint": entry.endpoint,
                    "in_flight": reply.in_flight,
                    "left_registry": left,
                }
            )
        else:
            print(
                f"draining {entry.role} worker {entry.worker_id} ({entry.model}) at {entry.endpoint}: "
                f"{reply.in_flight} request(s) in flight to finish"
            )
            if left:
                print(f"{entry.worker_id} has left the registry")
        if left is False:
            raise OperationFailed(f"{entry.worker_id} is still registered after {fmt_seconds(args.timeout)}")
        return 0

    return run_with_etcd(args, body)


def _drain_endpoint(args: argparse.Namespace, cluster: ClusterTLS | None, metadata: tuple[tuple[str, str], ...]) -> int:
    """Drain the worker at ``args.endpoint``; with ``--wait``, ask again until nothing is in
    flight (Drain is idempotent and answers the count) or the worker has stopped serving."""

    async def main() -> int:
        deadline = time.monotonic() + args.timeout
        async with secure_or_insecure_channel(args.endpoint, None if cluster is None else cluster.client) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            try:
                reply = await stub.Drain(worker_pb2.DrainRequest(), metadata=metadata, timeout=5.0)
            except grpc.aio.AioRpcError as error:
                raise OperationFailed(f"Drain RPC to {args.endpoint} failed: {error.code().name}: {error.details()}")
            first, in_flight = reply.in_flight, reply.in_flight
            while args.wait and in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                try:
                    in_flight = (await stub.Drain(worker_pb2.DrainRequest(), metadata=metadata, timeout=5.0)).in_flight
                except grpc.aio.AioRpcError:
                    in_flight = 0  # the worker finished its drain and closed its server
        if args.json:
            print_json({"endpoint": args.endpoint, "in_flight": first, "remaining": in_flight if args.wait else None})
        else:
            print(f"draining the worker at {args.endpoint}: {first} request(s) in flight to finish")
        if args.wait and in_flight:
            raise OperationFailed(
                f"the worker at {args.endpoint} still has {in_flight} request(s) in flight "
                f"after {fmt_seconds(args.timeout)}"
            )
        return 0

    try:
        return asyncio.run(main())
    except OperationFailed as error:
        return fail(args, str(error))


async def _wait_gone(client: aetcd.Client, entry: WorkerEntry, timeout_s: float) -> bool:
    """Whether the worker's entry (this incarnation of it) disappeared within ``timeout_s``."""
    key = worker_key(entry.model, entry.role, entry.worker_id).encode()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with asyncio.timeout(ETCD_TIMEOUT_S):
            kv = await client.get(key)
        if kv is None or _started_at(kv.value) != entry.started_at:  # gone, or restarted under the same id
            return True
        await asyncio.sleep(0.25)
    return False


def _started_at(value: bytes) -> float | None:
    try:
        return decode_entry(value).started_at
    except msgspec.DecodeError:
        return None
