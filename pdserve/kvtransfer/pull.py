"""Decode side: READ a request's KV blocks out of a prefill group, then tell it to free them.

``KVPuller.pull`` reads the blocks the decode side is missing (those after its own cached
prefix) from every prefill rank that holds some of its heads, using the per-peer prepared
descriptor lists, and sends a ``CompletionNotice`` to every prefill rank in its notify set —
on success, when nothing was needed, and when it gave up — so the prefill side never waits
for its deadline unless this process died.

Contract: when ``pull`` returns or raises, no transfer it posted is still writing into
``local_block_ids``, so the blocks may be freed at once. The caller owns them and frees them,
after a failure as after a success. A failed pull releases its handles (which cancels them)
before it raises. A successful one returns as soon as every transfer is done; releasing the
handles and sending the notices then go on in the background (``close`` waits for them), so
the request resumes without waiting for NIXL's bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from nixl._api import nixl_agent

from pdserve.kvtransfer.agent import KVAgent
from pdserve.kvtransfer.descriptors import SliceDescriptors
from pdserve.kvtransfer.messages import CompletionNotice, PeerInfo
from pdserve.kvtransfer.stats import TransferStats
from pdserve.kvtransfer.tp import HeadSlice, expected_notices, notify_set, sources

logger = logging.getLogger(__name__)


class TransferFailed(RuntimeError):
    """A pull did not complete (transfer error, peer gone, deadline passed, bad request)."""

    def __init__(self, request_id: str, reason: str) -> None:
        self.request_id = request_id
        self.reason = reason
        super().__init__(f"KV pull of {request_id!r} failed: {reason}")


class KVPuller:
    """Pulls requests' KV into this decode rank's pool through ``agent``.

    ``deadline_s`` bounds a whole pull (setup, transfer, notices); ``max_run_blocks`` caps a
    coalesced descriptor; ``cancel_grace_s`` is how long a timed-out transfer may take to
    acknowledge its cancellation before the pull reports failure anyway.
    """

    def __init__(
        self,
        agent: KVAgent,
        *,
        deadline_s: float = 30.0,
        max_run_blocks: int = 64,
        cancel_grace_s: float = 1.0,
    ) -> None:
        self.agent = agent
        self.deadline_s = deadline_s
        self.max_run_blocks = max_run_blocks
        self.cancel_grace_s = cancel_grace_s
        self._finishing: set[asyncio.Task[None]] = set()  # successful pulls' release and notices

    async def close(self) -> None:
        """Wait for the background releases and notices (each bounded by its pull's deadline)."""
        await asyncio.gather(*self._finishing, return_exceptions=True)

    async def pull(
        self,
        request_id: str,
        peers: str | Sequence[str],
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        *,
        num_cached_blocks: int = 0,
        deadline_s: float | None = None,
    ) -> TransferStats:
        """Read ``remote_block_ids[i]`` into ``local_block_ids[i]`` for ``i >= num_cached_blocks``.

        ``peers`` are the prefill group's agent names in TP-rank order (one name for TP 1),
        each added with ``KVAgent.add_peer``; every prefill rank has the same block table.
        Returns the stats; raises ``TransferFailed`` — after notifying the prefill ranks —
        within ``deadline_s`` (plus the cancel grace, plus any NIXL call already running on
        the agent's thread) whatever the peers do. Cancelling the pull cancels its transfers
        and still notifies.
        """
        start = time.perf_counter()
        deadline = start + (self.deadline_s if deadline_s is None else deadline_s)
        names = [peers] if isinstance(peers, str) else list(peers)
        handles: list[tuple[Any, str]] = []
        stats = TransferStats(
            request_id=request_id,
            num_blocks=0,
            num_bytes=0,
            num_descriptors=0,
            num_transfers=0,
            setup_seconds=0.0,
            seconds=0.0,
        )
        failure: str | None = None
        try:
            infos = self._group(names)
            remote = np.asarray(remote_block_ids, dtype=np.int64)[num_cached_blocks:]
            if len(local_block_ids) < len(remote_block_ids):
                raise ValueError(f"{len(local_block_ids)} local blocks for {len(remote_block_ids)} remote")
            local = np.asarray(local_block_ids, dtype=np.int64)[num_cached_blocks : len(remote_block_ids)]
            stats.num_blocks = len(remote)
            if len(remote):
                plans = []
                for head_slice in sources(self.agent.layout, len(infos)):
                    peer = infos[head_slice.remote_rank]
                    descs = await self._descriptors(peer, head_slice)
                    local_idx, remote_idx, num_bytes = descs.indices(remote, local)
                    plans.append((descs, local_idx, remote_idx))
                    stats.num_bytes += num_bytes
                    stats.num_descriptors += len(local_idx)
                posted, made_at = await self.agent.call(_post, plans)
                handles = [(h, d.remote_name) for h, d, _ in posted]
                stats.num_transfers = len(posted)
                stats.setup_seconds = made_at - start
                await self._wait(posted, deadline)
        except (ValueError, KeyError) as exc:
            failure = f"bad request: {exc}"
        except TransferFailed as exc:
            failure = exc.reason
        except asyncio.CancelledError:  # the request was aborted: still cancel and notify
            failure = "cancelled"
            raise
        except Exception as exc:  # NIXL errors (e.g. a dead peer at post time)
            failure = f"{type(exc).__name__}: {exc}"
        finally:
            if failure is None:  # every transfer is done: nothing writes into the blocks any more
                task = asyncio.get_running_loop().create_task(self._finish(request_id, names, handles, None, deadline))
                self._finishing.add(task)
                task.add_done_callback(self._finishing.discard)
            else:
                await self._finish(request_id, names, handles, failure, deadline)
        stats.seconds = time.perf_counter() - start
        if failure is not None:
            raise TransferFailed(request_id, failure)
        return stats

    async def _finish(
        self, request_id: str, names: list[str], handles: list[tuple[Any, str]], failure: str | None, deadline: float
    ) -> None:
        if handles:
            await self._release(handles)
        await self._notify(request_id, names, failure, deadline)

    def _group(self, names: list[str]) -> list[PeerInfo]:
        """The prefill group's infos in rank order, checked to be one whole group."""
        if not names:
            raise ValueError("no prefill peer named")
        try:
            infos = [self.agent.peer(name) for name in names]
        except KeyError as exc:
            raise TransferFailed("", f"unknown or removed peer {exc}") from None
        size = infos[0].layout.tp_size
        ranks = [info.layout.tp_rank for info in infos]
        if ranks != list(range(size)) or any(info.layout.tp_size != size for info in infos):
            raise ValueError(f"peers must be one prefill group in rank order, got ranks {ranks}")
        return infos

    async def _descriptors(self, peer: PeerInfo, head_slice: HeadSlice) -> SliceDescriptors:
        """The prepared lists for this (peer, slice): built on first use, then reused."""
        cache = self.agent.peer_state(peer.agent_name)
        key = ("slice", head_slice)
        pending = cache.get(key)
        if pending is None:
            # Cache the future itself, so concurrent first pulls prepare the lists only once.
            pending = asyncio.ensure_future(
                self.agent.call(SliceDescriptors.build, self.agent.info, peer, head_slice, self.max_run_blocks)
            )
            cache[key] = pending
            try:
                descs = await pending
            except BaseException:
                cache.pop(key, None)
                raise
            if self.agent.has_peer(peer.agent_name):
                self.agent.attach(peer.agent_name, descs.release)
            else:  # the peer went away while preparing: nobody else will release them
                await self.agent.call(descs.release)
                raise TransferFailed("", f"peer {peer.agent_name} removed")
            return descs
        return await asyncio.shield(pending)

    async def _wait(self, posted: list[tuple[Any, SliceDescriptors, str]], deadline: float) -> None:
        futures = []
        for handle, descs, state in posted:
            if state == "ERR":
                raise TransferFailed("", f"posting the read from {descs.remote_name} failed")
            if state == "PROC":
                futures.append(self.agent.watch(handle, descs.remote_name))
        if not futures:
            return
        done, pending = await asyncio.wait(
            futures, timeout=max(0.0, deadline - time.perf_counter()), return_when=asyncio.FIRST_EXCEPTION
        )
        for future in done:
            if future.exception() is not None:
                for other in futures:
                    other.cancel()
                raise TransferFailed("", str(future.exception()))
        if pending:
            for future in pending:
                future.cancel()
            raise TransferFailed("", "deadline passed before the transfer completed")

    async def _release(self, handles: list[tuple[Any, str]]) -> None:
        """Release (and so cancel) every posted transfer; wait a grace period for stragglers."""
        for handle, _ in handles:
            self.agent.unwatch(handle)
        grace_end = time.perf_counter() + self.cancel_grace_s
        remaining = [h for h, _ in handles]
        while remaining:
            remaining = await self.agent.call(_try_release, remaining)
            if not remaining or time.perf_counter() > grace_end:
                break
            await asyncio.sleep(0.01)
        if remaining:
            logger.error("%d NIXL transfers did not cancel within %.1fs", len(remaining), self.cancel_grace_s)
            self.agent.keep_unreleased(remaining)

    async def _notify(self, request_id: str, names: list[str], failure: str | None, deadline: float) -> None:
        """Tell every prefill rank in the notify set that it may free (never raises)."""
        size = len(names)  # the group size, once _group has accepted the names
        messages = []
        for rank in notify_set(self.agent.layout, size):
            if rank < len(names) and self.agent.has_peer(names[rank]):
                notice = CompletionNotice(
                    request_id=request_id,
                    sender_rank=self.agent.layout.tp_rank,
                    num_expected=expected_notices(rank, self.agent.layout, size),
                    ok=failure is None,
                    reason=failure,
                )
                messages.append((names[rank], notice.encode()))
        try:
            # Bounded even if a send blocks on a dead peer: the prefill side's deadline covers it.
            timeout = max(0.5, deadline - time.perf_counter())
            async with asyncio.timeout(timeout):
                await self.agent.call(_send_notices, messages)
        except Exception:
            logger.warning("completion notices for %s not sent", request_id, exc_info=True)


def _post(
    nx: nixl_agent, plans: list[tuple[SliceDescriptors, np.ndarray, np.ndarray]]
) -> tuple[list[tuple[Any, SliceDescriptors, str]], float]:
    """Make one prepared READ per slice, then post them all (NIXL thread).

    Returns the handles with their post states (DONE/PROC/ERR) and the time at which every
    request was made — the end of setup; posting can move data synchronously on some
    transports (UCX over TCP/CMA), so it is not counted as setup.
    """
    made = []
    try:
        for descs, local_idx, remote_idx in plans:
            handle = nx.make_prepped_xfer("READ", descs.local_handle, local_idx, descs.remote_handle, remote_idx)
            made.append((handle, descs))
    except Exception:
        for handle, _ in made:
            handle.release()
        raise
    made_at = time.perf_counter()
    return [(handle, descs, nx.transfer(handle)) for handle, descs in made], made_at


def _try_release(nx: nixl_agent, handles: list[Any]) -> list[Any]:
    """Release handles; those NIXL cannot cancel yet are returned to retry."""
    left = []
    for handle in handles:
        try:
            handle.release()
        except Exception:
            left.append(handle)
    return left


def _send_notices(nx: nixl_agent, messages: list[tuple[str, bytes]]) -> None:
    for name, message in messages:
        try:
            nx.send_notif(name, message)
        except Exception:
            logger.warning("completion notice to %s failed", name, exc_info=True)
