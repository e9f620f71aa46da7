"""The process's NIXL agent: registration, peers, and the one thread every NIXL call runs on.

NIXL agents are not thread-safe, so a ``KVAgent`` owns one dedicated thread and runs every
NIXL call there (``call``); workers use it from asyncio through awaitables. It registers the
whole KV pool (``KVCache.data``, one tensor) once in ``start`` and deregisters it in
``close``. A poller task watches posted transfers and incoming notifications, only while
there is something to watch.

Peers are cached by agent name and identity: ``add_peer`` checks the peer's layout *before*
loading its NIXL metadata (a mismatch never reaches NIXL), returns the cached peer only when
its whole ``PeerInfo`` is the same (a restarted process keeps its name, never its NIXL
metadata, and is re-loaded), and ``remove_peer`` — called when the peer's
registration disappears — releases everything held for it and fails its in-flight transfers
at once, which is how a dead peer is noticed before a transfer's own deadline.

Security: the KV data plane is for a trusted network only. NIXL (UCX) moves KV blocks and
completion notices unencrypted and unauthenticated, to any agent whose metadata a peer holds:
the cluster's mTLS (``pdserve.rpc.tls.ClusterTLS``) covers the gRPC control calls, not these
bytes. Keep the workers' NIXL traffic on a private network (README: Security).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import nixl._bindings as nixl_bindings
from nixl._api import nixl_agent, nixl_agent_config

from pdserve.kvtransfer.layout import KVLayout, check_compatible
from pdserve.kvtransfer.messages import PeerInfo
from pdserve.model.kv_cache import THP_SETTING, KVCache

logger = logging.getLogger(__name__)

T = TypeVar("T")
NotificationHandler = Callable[[str, bytes], None]


class PeerGone(RuntimeError):
    """The peer was removed (its registration vanished, or the agent closed) mid-transfer."""


class XferError(RuntimeError):
    """NIXL reported a transfer as failed (for example, the remote process died)."""


class _Watch:
    __slots__ = ("handle", "peer", "future")

    def __init__(self, handle: Any, peer: str, future: asyncio.Future[None]) -> None:
        self.handle = handle
        self.peer = peer
        self.future = future


class KVAgent:
    """One NIXL agent per worker process; every NIXL call serialized on one thread.

    Construct, then ``await start()``; ``await close()`` when done (it owns the thread, the
    registration and every per-peer resource). ``loopback_only``: every peer is on this machine
    (the worker is reached at a loopback address), so the agent listens on loopback alone.
    """

    def __init__(
        self,
        name: str,
        kv_cache: KVCache,
        layout: KVLayout,
        *,
        backends: tuple[str, ...] = ("UCX",),
        loopback_only: bool = False,
        poll_interval_s: float = 0.0005,
        notif_poll_interval_s: float = 0.005,
        progress_delay_us: int = 1000,
    ) -> None:
        if not kv_cache.data.is_contiguous():
            raise ValueError("the KV pool must be one contiguous tensor to register it once")
        self.name = name
        self.kv_cache = kv_cache
        self.layout = layout
        self.backends = backends
        self.loopback_only = loopback_only
        self.poll_interval_s = poll_interval_s
        self.notif_poll_interval_s = notif_poll_interval_s
        self.progress_delay_us = progress_delay_us
        self._executor: ThreadPoolExecutor | None = None
        self._nixl: nixl_agent | None = None
        self._registration: Any = None
        self._info: PeerInfo | None = None
        self._peers: dict[str, PeerInfo] = {}
        # Per-peer release callbacks (prepared descriptor lists), run on the NIXL thread.
        self._attached: dict[str, list[Callable[[nixl_agent], None]]] = {}
        # Per-peer scratch state of the layers above (prepared descriptor lists), dropped with it.
        self._peer_state: dict[str, dict[Any, Any]] = {}
        self._watches: dict[int, _Watch] = {}
        # Transfer handles NIXL would not release (still active); kept so that their
        # finalizers never run NIXL code off the NIXL thread, retried at close.
        self._unreleased: list[Any] = []
        self._handlers: list[tuple[NotificationHandler, Callable[[], bool]]] = []
        self._wake = asyncio.Event()
        self._adding = asyncio.Lock()
        self._poller: asyncio.Task[None] | None = None
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Create the NIXL agent and register the KV pool (once)."""
        if self.kv_cache.small_pages_reason is not None:
            logger.warning(
                "%s: the KV cache is not on huge pages, so other processes pull its blocks at about half the "
                "speed: %s. Enable them with `echo madvise > %s` (as root, on the host).",
                self.name,
                self.kv_cache.small_pages_reason,
                THP_SETTING,
            )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nixl-{self.name}")
        self._info = await self.call(self._start_on_thread)
        self._poller = asyncio.get_running_loop().create_task(self._poll_loop())

    def _start_on_thread(self, _: None) -> PeerInfo:
        if self.loopback_only:
            # UCX's TCP transport listens on every network interface it uses; a worker whose
            # peers are all on this machine needs loopback alone (shared memory is no network
            # device, so it stays). Read by UCX when its backend starts, not by pdserve.
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        self._nixl = _make_nixl_agent(self.name, self.backends, self.progress_delay_us)
        self._registration = self._nixl.register_memory(self.kv_cache.data)
        return PeerInfo(
            agent_name=self.name,
            agent_metadata=self._nixl.get_agent_metadata(),
            layout=self.layout,
            base_address=self.kv_cache.data.data_ptr(),
            mem_type="DRAM" if self.kv_cache.data.device.type == "cpu" else "VRAM",
            device_id=max(self.kv_cache.data.get_device(), 0),
            num_blocks=self.kv_cache.num_blocks,
        )

    async def close(self) -> None:
        """Fail in-flight transfers, release per-peer resources, deregister, stop the thread."""
        if self._closed or self._executor is None:
            self._closed = True
            return
        self._closed = True
        self._wake.set()
        if self._poller is not None:
            async with asyncio.timeout(5.0):
                await self._poller
        for name in list(self._peers):
            await self.remove_peer(name, reason="agent closed")
        await self.call(self._close_on_thread)
        self._executor.shutdown(wait=True)

    def _close_on_thread(self, nx: nixl_agent) -> None:
        for handle in self._unreleased:
            try:
                handle.release()
            except Exception:
                logger.error("a NIXL transfer handle could not be released at close")
        self._unreleased.clear()
        if self._registration is not None:
            nx.deregister_memory(self._registration)
            self._registration = None
        self._nixl = None  # the binding tears the agent down when the last reference goes

    # ---- the NIXL thread ---------------------------------------------------------------
    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(nixl_agent, *args)`` on the NIXL thread and await its result."""
        if self._executor is None:
            raise RuntimeError("KVAgent.start() has not run")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(self._nixl, *args))

    # ---- identity and peers ------------------------------------------------------------
    @property
    def info(self) -> PeerInfo:
        """This worker's published metadata (``info.encode()`` goes into the registry)."""
        if self._info is None:
            raise RuntimeError("KVAgent.start() has not run")
        return self._info

    def peer(self, name: str) -> PeerInfo:
        """A loaded peer's metadata; ``KeyError`` if it was never added or was removed."""
        return self._peers[name]

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    async def add_peer(self, info: bytes | PeerInfo) -> PeerInfo:
        """Load a peer's metadata (cached by name), after checking its KV layout.

        Raises ``LayoutMismatch`` before NIXL ever sees the peer when the layouts differ.
        """
        peer = PeerInfo.decode(info) if isinstance(info, bytes) else info
        check_compatible(self.layout, peer.layout)
        async with self._adding:  # concurrent first pulls from one peer load it once
            return await self._add_peer(peer)

    async def _add_peer(self, peer: PeerInfo) -> PeerInfo:
        known = self._peers.get(peer.agent_name)
        if known is not None:
            if known == peer:
                return known
            # The same name with other metadata (a new NIXL address, a new KV pool): the process
            # restarted. Nothing of the old one may be used again: its in-flight transfers fail.
            await self.remove_peer(peer.agent_name, reason="peer restarted (its metadata changed)")
        loaded = await self.call(_load_peer, peer.agent_metadata)
        if loaded != peer.agent_name:
            await self.call(lambda nx: nx.remove_remote_agent(loaded))
            raise ValueError(f"peer metadata names agent {loaded!r}, not {peer.agent_name!r}")
        self._peers[peer.agent_name] = peer
        self._attached[peer.agent_name] = []
        self._peer_state[peer.agent_name] = {}
        return peer

    def peer_state(self, name: str) -> dict[Any, Any]:
        """A dict for per-peer caches of the layers above; dropped when the peer is removed."""
        return self._peer_state[name]

    def attach(self, peer: str, release: Callable[[nixl_agent], None]) -> None:
        """Tie a per-peer NIXL resource to the peer: ``release`` runs when it is removed."""
        self._attached[peer].append(release)

    async def remove_peer(self, name: str, reason: str = "peer removed") -> None:
        """Forget a peer: fail its in-flight transfers now, release its resources."""
        if name not in self._peers:
            return
        del self._peers[name]
        self._peer_state.pop(name, None)
        for key, watch in list(self._watches.items()):
            if watch.peer == name:
                del self._watches[key]
                if not watch.future.done():
                    watch.future.set_exception(PeerGone(f"{name}: {reason}"))
                # The pull that posted it releases the handle (it knows when that is safe).
        releases = self._attached.pop(name, [])
        await self.call(_remove_peer_on_thread, name, releases)

    # ---- transfers and notifications -------------------------------------------------------
    def watch(self, handle: Any, peer: str) -> asyncio.Future[None]:
        """A future that completes when the posted transfer ``handle`` is done, or fails."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if peer not in self._peers:
            future.set_exception(PeerGone(f"{peer}: not a known peer"))
            return future
        self._watches[id(handle)] = _Watch(handle, peer, future)
        self._wake.set()
        return future

    def unwatch(self, handle: Any) -> None:
        self._watches.pop(id(handle), None)

    def keep_unreleased(self, handles: list[Any]) -> None:
        """Take ownership of transfer handles that could not be released yet (see close)."""
        self._unreleased.extend(handles)

    def add_notification_handler(
        self, handler: NotificationHandler, is_wanted: Callable[[], bool] = lambda: True
    ) -> None:
        """Call ``handler(sender_agent_name, message)`` for every incoming notification.

        Notifications are polled only while some handler's ``is_wanted()`` is true (NIXL
        queues them meanwhile): an idle worker then costs no CPU. Call ``wake()`` when
        ``is_wanted`` turns true.
        """
        self._handlers.append((handler, is_wanted))
        self._wake.set()

    def remove_notification_handler(self, handler: NotificationHandler) -> None:
        self._handlers = [(h, w) for h, w in self._handlers if h is not handler]

    def wake(self) -> None:
        """Make the poller re-check what it should watch (new interest in notifications)."""
        self._wake.set()

    async def _poll_loop(self) -> None:
        while not self._closed:
            want_notifs = any(is_wanted() for _, is_wanted in self._handlers)
            if not self._watches and not want_notifs:
                self._wake.clear()
                await self._wake.wait()
                continue
            watches = list(self._watches.values())
            try:
                states, notifs = await self.call(_poll, [w.handle for w in watches], want_notifs)
            except Exception:  # a broken agent must not kill the poller silently
                logger.exception("NIXL poll failed")
                states, notifs = ["ERR"] * len(watches), {}
            for watch, state in zip(watches, states):
                if state == "PROC" or watch.future.done():
                    continue
                self._watches.pop(id(watch.handle), None)
                if state == "DONE":
                    watch.future.set_result(None)
                else:
                    watch.future.set_exception(XferError(f"transfer from {watch.peer} failed"))
            for sender, messages in notifs.items():
                for message in messages:
                    for handler, _ in list(self._handlers):
                        try:
                            handler(sender, message)
                        except Exception:
                            logger.exception("notification handler failed")
            interval = self.poll_interval_s if self._watches else self.notif_poll_interval_s
            self._wake.clear()
            try:
                async with asyncio.timeout(interval):
                    await self._wake.wait()
            except TimeoutError:
                pass


def _make_nixl_agent(name: str, backends: tuple[str, ...], progress_delay_us: int) -> nixl_agent:
    """A NIXL agent whose progress thread sleeps ``progress_delay_us`` between rounds.

    The Python wrapper pins that delay at 0: a sched_yield spin costing ~70% of a core per
    idle process here (2% at 1000 us), fatal with several workers on a 2-core machine. So
    the wrapper is built with no backend and no progress thread, the binding's agent is
    replaced by one with the delay set, and the backends are created on that one.
    """
    wrapper = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    config = nixl_bindings.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.pthrDelay = progress_delay_us
    config.syncMode = nixl_bindings.NIXL_THREAD_SYNC_NONE  # calls come from one thread
    wrapper.agent = nixl_bindings.nixlAgent(name, config)
    for backend in backends:
        wrapper.create_backend(backend, {})
    return wrapper


def _load_peer(nx: nixl_agent, metadata: bytes) -> str:
    name = nx.add_remote_agent(metadata)
    if isinstance(name, bytes):  # the binding returns the name as bytes
        name = name.decode()
    try:
        # Connect now, so the first transfer does not pay the connection setup (~100 ms).
        nx.make_connection(name)
    except Exception:  # the first transfer connects lazily instead
        logger.warning("NIXL make_connection to %s failed; connecting lazily", name)
    return name


def _remove_peer_on_thread(nx: nixl_agent, name: str, releases: list[Callable[[nixl_agent], None]]) -> None:
    for release in releases:
        try:
            release(nx)
        except Exception:
            logger.exception("releasing a NIXL resource of peer %s failed", name)
    try:
        nx.remove_remote_agent(name)
    except Exception:
        logger.exception("removing NIXL peer %s failed", name)


def _poll(nx: nixl_agent, handles: list[Any], want_notifs: bool) -> tuple[list[str], dict[str, list[bytes]]]:
    states = []
    for handle in handles:
        try:
            states.append(nx.check_xfer_state(handle))
        except Exception:
            states.append("ERR")
    return states, (nx.get_new_notifs() if want_notifs else {})
