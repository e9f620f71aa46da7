"""A prefill or decode peer in its own process, driven by JSON-line commands on stdin.

``python -m tests.kvtransfer.peer_main '<PeerConfig JSON>'``. It owns a real KV pool, a real
block pool and KV cache manager, and a real NIXL agent; replies go to the original stdout,
while anything native code prints goes to stderr. A prefill peer stands in for its engine:
the engine's ``BlockPins`` pin the blocks, a ``SentReporter`` reports them sent, and a sweep
expires the pins at their deadlines as the engine's step does.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys

import msgspec
import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.pins import BlockPins
from pdserve.kvtransfer import KVAgent, KVLayout, KVPuller, LayoutMismatch, SentReporter, TransferFailed
from pdserve.lifecycle import cancel_and_wait
from pdserve.model.kv_cache import KVCache
from tests.kvtransfer import protocol as p

SENTINEL = 0x5A  # bytes of a decode block "already cached": a pull must not overwrite them
SWEEP_INTERVAL_S = 0.05


class Peer:
    def __init__(self, cfg: p.PeerConfig, out) -> None:
        self.cfg = cfg
        self.out = out
        spec = cfg.spec()
        self.kv = KVCache(spec, cfg.num_blocks, torch.device("cpu"))
        if cfg.seed is not None:
            self.kv.data.copy_(p.prefill_contents(cfg))
        self.pool = BlockPool(cfg.num_blocks, enable_prefix_caching=False)
        # Shuffle the free queue: allocations then come out scattered over the pool.
        if cfg.scatter_seed is not None:
            ids = self.pool.allocate(cfg.num_blocks)
            random.Random(cfg.scatter_seed).shuffle(ids)
            self.pool.release(ids)
        self.manager = KVCacheManager(self.pool, cfg.block_size)
        layout = KVLayout.from_spec(spec, cfg.model, cfg.tp_size, cfg.tp_rank)
        self.agent = KVAgent(cfg.name, self.kv, layout)
        self.pins = BlockPins(self.manager.free)
        self.reporter = SentReporter(self.agent, self.pins.sent, is_wanted=lambda: len(self.pins) > 0)
        self.puller = KVPuller(self.agent)

    def send(self, reply: p.Reply) -> None:
        self.out.write(msgspec.json.encode(reply) + b"\n")
        self.out.flush()

    async def pull(self, cmd: p.Pull) -> p.PullResult:
        if not self.manager.allocate(cmd.request_id, cmd.num_tokens):
            return p.PullResult(cmd.request_id, False, [], error="decode pool full")
        local = list(self.manager.block_table(cmd.request_id))
        for block in local[: cmd.num_cached_blocks]:
            self.kv.data[block].view(torch.uint8).fill_(SENTINEL)
        try:
            stats = await self.puller.pull(
                cmd.request_id,
                cmd.peers,
                cmd.remote_block_ids,
                local,
                num_cached_blocks=cmd.num_cached_blocks,
                deadline_s=cmd.deadline_s,
            )
        except TransferFailed as exc:  # the blocks are ours to give back
            self.manager.free(cmd.request_id)
            return p.PullResult(cmd.request_id, False, local, error=exc.reason)
        if not cmd.keep:
            self.manager.free(cmd.request_id)
        return p.PullResult(cmd.request_id, True, local, stats=stats)

    async def pull_loop(self, cmd: p.PullLoop) -> p.LoopResult:
        loop = asyncio.get_running_loop()
        end = loop.time() + cmd.max_seconds
        counter = 0
        num_ok = 0

        async def worker() -> p.PullResult | None:
            nonlocal counter, num_ok
            while loop.time() < end:
                counter += 1
                rid = f"{cmd.template.request_id}-{counter}"
                result = await self.pull(msgspec.structs.replace(cmd.template, request_id=rid, keep=False))
                if not result.ok:
                    return result
                num_ok += 1
            return None

        results = await asyncio.gather(*(worker() for _ in range(cmd.concurrency)))
        failures = [r for r in results if r is not None]
        return p.LoopResult(num_ok, failures[0] if failures else None)

    async def handle(self, cmd: p.Command) -> p.Reply:
        if isinstance(cmd, p.AddPeer):
            try:
                await self.agent.add_peer(cmd.info)
            except LayoutMismatch as exc:
                return p.Done(False, str(exc), exc.field)
            return p.Done()
        if isinstance(cmd, p.RemovePeer):
            await self.agent.remove_peer(cmd.name)
            return p.Done()
        if isinstance(cmd, p.Hold):
            if not self.manager.allocate(cmd.request_id, cmd.num_tokens):
                return p.Done(False, "prefill pool full")
            blocks = list(self.manager.block_table(cmd.request_id))
            self.pins.pin(cmd.request_id, self.cfg.hold_deadline_s if cmd.deadline_s is None else cmd.deadline_s)
            self.reporter.wake()
            return p.Held(blocks)
        if isinstance(cmd, p.Pull):
            return await self.pull(cmd)
        if isinstance(cmd, p.PullMany):
            return p.PullResults(list(await asyncio.gather(*(self.pull(c) for c in cmd.pulls))))
        if isinstance(cmd, p.PullLoop):
            return await self.pull_loop(cmd)
        if isinstance(cmd, p.Dump):
            self.kv.data.view(torch.uint8).numpy().tofile(cmd.path)
            return p.Done()
        if isinstance(cmd, p.Release):
            self.manager.free(cmd.request_id)
            return p.Done()
        if isinstance(cmd, p.Status):
            try:
                self.pool.check_integrity()
                error = None
            except AssertionError as exc:
                error = str(exc) or "integrity check failed"
            return p.PoolStatus(
                self.pool.num_blocks,
                self.pool.num_free_blocks,
                error,
                len(self.pins),
                self.pins.num_freed_by_sent,
                self.pins.num_freed_by_deadline,
                self.reporter.num_reported,
            )
        raise ValueError(f"unknown command {cmd!r}")

    async def safe_handle(self, cmd: p.Command) -> p.Reply:
        try:
            return await self.handle(cmd)
        except Exception as exc:  # reported to the test, which fails on it
            return p.Done(False, f"{type(exc).__name__}: {exc}")

    async def sweep(self) -> None:
        while True:
            self.pins.expire()
            await asyncio.sleep(SWEEP_INTERVAL_S)

    async def run(self) -> None:
        await self.agent.start()
        self.reporter.start()
        sweeper = asyncio.ensure_future(self.sweep())
        self.send(p.Ready(self.agent.info.encode()))
        loop = asyncio.get_running_loop()
        # Commands arrive on stdin, read by the event loop itself (no thread left blocked in
        # a read at exit); EOF — the test went away — ends the peer like Exit.
        reader = asyncio.StreamReader(limit=64 << 20)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        decoder = msgspec.json.Decoder(p.Command)
        tasks = set()
        while True:
            line = await reader.readline()
            if not line:
                break
            cmd = decoder.decode(line)
            if isinstance(cmd, p.Exit):
                break
            # Commands run concurrently; replies come back in completion order, tagged by
            # type, and the tests send one command at a time unless they mean to overlap.
            task = asyncio.ensure_future(self.safe_handle(cmd))
            tasks.add(task)
            task.add_done_callback(lambda t: (tasks.discard(t), self.send(t.result())))
        await cancel_and_wait(sweeper)
        await self.puller.close()
        self.reporter.close()
        self.pins.release_all()
        await self.agent.close()
        self.send(p.Done())


def main() -> None:
    cfg = msgspec.json.decode(sys.argv[1], type=p.PeerConfig)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # native code printing to stdout must not corrupt the reply stream
    asyncio.run(Peer(cfg, out).run())


if __name__ == "__main__":
    main()
