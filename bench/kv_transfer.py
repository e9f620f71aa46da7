"""KV transfer benchmark: a request's blocks (4,096 tokens by default), scattered vs one
contiguous region.

Two processes: this one is the decode side (``KVAgent`` + ``KVPuller``); it starts a prefill
process (``--role prefill``) that registers its pool and publishes its ``PeerInfo`` on
stdout (msgspec JSON; nothing pickled). For each layout the decode side pulls the request's
blocks — scattered randomly over both pools, through the real pull path (prepared
descriptor lists, coalescing, completion notice) — and then the same number of bytes as one
contiguous region with a single descriptor (the ceiling).

    python -m bench.kv_transfer --json
    python -m bench.kv_transfer --json --layouts smollm2-135m --tokens 304   # a serving-sized request

prints one JSON list, an object per layout: layout, tokens, bytes, scattered_gbps,
contiguous_gbps, ratio (scattered / contiguous), setup_ms_p50, setup_ms_p99 (the time from
``pull`` until every READ is posted: indices, make_prepped_xfer, post, one thread hop).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np
import torch

from bench.lib.report import median, nearest_rank
from pdserve.kvtransfer import KVAgent, KVLayout, KVPuller, PeerInfo
from pdserve.model.kv_cache import KVCache, KVCacheSpec

ROOT = Path(__file__).resolve().parents[1]

TOKENS = 4096
BLOCK_SIZE = 16
LAYOUTS = {
    # SmolLM2-135M, the default model's shape: 30 layers, 3 KV heads x 64, float32 → 45 KiB per token.
    "smollm2-135m": KVCacheSpec(
        num_layers=30, block_size=BLOCK_SIZE, dtype=torch.float32, is_mla=False, num_kv_heads=3, head_dim=64
    ),
    # Llama-3.1-8B: 32 layers, 8 KV heads x 128, bf16 → 128 KiB per token.
    "llama-3.1-8b": KVCacheSpec(
        num_layers=32, block_size=BLOCK_SIZE, dtype=torch.bfloat16, is_mla=False, num_kv_heads=8, head_dim=128
    ),
    # DeepSeek-V3 MLA: 61 layers x (512 latent + 64 rope) = 576, bf16 → 68.6 KiB per token.
    "deepseek-v3-mla": KVCacheSpec(
        num_layers=61, block_size=BLOCK_SIZE, dtype=torch.bfloat16, is_mla=True, latent_dim=576
    ),
    # The same with kv_cache_dtype="fp8_e4m3": one byte a value, so half the bytes a token moves.
    "llama-3.1-8b-fp8": KVCacheSpec(
        num_layers=32, block_size=BLOCK_SIZE, dtype=torch.float8_e4m3fn, is_mla=False, num_kv_heads=8, head_dim=128
    ),
    "deepseek-v3-mla-fp8": KVCacheSpec(
        num_layers=61, block_size=BLOCK_SIZE, dtype=torch.float8_e4m3fn, is_mla=True, latent_dim=576
    ),
}


class BenchConfig(msgspec.Struct, frozen=True):
    layout: str
    num_blocks: int
    progress_delay_us: int
    tokens: int = TOKENS


def pool_for(cfg: BenchConfig, name: str, tp_rank: int = 0) -> tuple[KVCache, KVLayout]:
    spec = LAYOUTS[cfg.layout]
    kv = KVCache(spec, cfg.num_blocks, torch.device("cpu"))
    return kv, KVLayout.from_spec(spec, cfg.layout, 1, tp_rank)


async def prefill_main(cfg: BenchConfig, out) -> None:
    """The prefill process: register, publish, stay up until stdin closes."""
    kv, layout = pool_for(cfg, "prefill")
    kv.data.view(torch.uint8).random_(0, 256)  # real bytes, not a zero page
    agent = KVAgent(f"bench-prefill-{os.getpid()}", kv, layout, progress_delay_us=cfg.progress_delay_us)
    await agent.start()
    out.write(msgspec.json.encode(agent.info.encode()) + b"\n")
    out.flush()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.buffer.read)  # EOF: the decode side is done
    await agent.close()


async def contiguous_read(agent: KVAgent, peer: PeerInfo, num_bytes: int) -> float:
    """Seconds to READ ``num_bytes`` as one descriptor (the ceiling), same polling path."""
    local = agent.info

    def post(nx):
        dev = local.mem_type
        local_d = nx.get_xfer_descs(np.array([[local.base_address, num_bytes, 0]], dtype=np.uint64), dev)
        remote_d = nx.get_xfer_descs(np.array([[peer.base_address, num_bytes, 0]], dtype=np.uint64), dev)
        handle = nx.initialize_xfer("READ", local_d, remote_d, peer.agent_name)
        return handle, nx.transfer(handle)

    start = time.perf_counter()
    handle, state = await agent.call(post)
    if state == "PROC":
        await asyncio.wait_for(agent.watch(handle, peer.agent_name), timeout=60)
    elif state != "DONE":
        raise RuntimeError("contiguous read failed")
    seconds = time.perf_counter() - start
    await agent.call(lambda nx: handle.release())
    return seconds


async def bench_layout(cfg: BenchConfig, reps: int, seed: int, prefill_prefix: Sequence[str] = ()) -> dict:
    """Pull one request's blocks ``reps`` times from a prefill child started as ``prefill_prefix`` + its argv
    (``bench.hosts`` gives a prefix that starts it on another host)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # the child imports this package from any working directory
    argv = [
        sys.executable,
        "-m",
        "bench.kv_transfer",
        "--role",
        "prefill",
        "--config",
        msgspec.json.encode(cfg).decode(),
    ]
    proc = subprocess.Popen(
        [*prefill_prefix, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    kv, layout = pool_for(cfg, "decode")
    agent = KVAgent(f"bench-decode-{os.getpid()}", kv, layout, progress_delay_us=cfg.progress_delay_us)
    await agent.start()
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout=120)
        peer = await agent.add_peer(msgspec.json.decode(line, type=bytes))
        puller = KVPuller(agent, deadline_s=60)
        num_blocks = cfg.tokens // BLOCK_SIZE
        rng = np.random.default_rng(seed)
        num_bytes = num_blocks * layout.bytes_per_block
        scattered, setups, contiguous = [], [], []
        for rep in range(reps + 1):  # rep 0 warms up: prepares the descriptor lists once
            remote = rng.choice(cfg.num_blocks, num_blocks, replace=False).tolist()
            local = rng.choice(cfg.num_blocks, num_blocks, replace=False).tolist()
            stats = await puller.pull(f"bench-{rep}", peer.agent_name, remote, local)
            assert stats.num_bytes == num_bytes
            seconds = await contiguous_read(agent, peer, num_bytes)
            if rep:
                scattered.append(stats.seconds)
                setups.append(stats.setup_seconds)
                contiguous.append(seconds)
        await puller.close()
    finally:
        await agent.close()
        proc.stdin.close()
        proc.wait(timeout=60)
    scattered_gbps = num_bytes / median(scattered) / 1e9
    contiguous_gbps = num_bytes / median(contiguous) / 1e9
    setups_ms = sorted(s * 1e3 for s in setups)
    return {
        "layout": cfg.layout,
        "tokens": cfg.tokens,
        "bytes": num_bytes,
        "scattered_gbps": round(scattered_gbps, 3),
        "contiguous_gbps": round(contiguous_gbps, 3),
        "ratio": round(scattered_gbps / contiguous_gbps, 3),
        "setup_ms_p50": median(setups_ms, 3),
        "setup_ms_p99": round(nearest_rank(setups_ms, 0.99), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON list (the only output)")
    parser.add_argument("--reps", type=int, default=20, help="measured pulls per layout")
    parser.add_argument("--pool-factor", type=int, default=2, help="pool size in requests' worth of blocks")
    parser.add_argument("--progress-delay-us", type=int, default=1000)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument(
        "--tokens", type=int, default=TOKENS, help=f"the request's tokens, whole blocks (default: {TOKENS})"
    )
    parser.add_argument("--role", default="decode", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--prefill-prefix", default="[]", help=argparse.SUPPRESS)  # JSON argv list
    args = parser.parse_args()
    # Our output goes to the saved stdout; anything native code prints goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    if args.role == "prefill":
        asyncio.run(prefill_main(msgspec.json.decode(args.config, type=BenchConfig), out))
        return
    if args.tokens < BLOCK_SIZE or args.tokens % BLOCK_SIZE:
        parser.error(f"--tokens must be a positive multiple of the block size ({BLOCK_SIZE}), got {args.tokens}")
    unknown = sorted(set(args.layouts.split(",")) - set(LAYOUTS))
    if unknown:
        parser.error(f"--layouts: unknown {', '.join(unknown)} (known: {', '.join(LAYOUTS)})")
    results = []
    for name in args.layouts.split(","):
        cfg = BenchConfig(name, args.pool_factor * args.tokens // BLOCK_SIZE, args.progress_delay_us, args.tokens)
        prefix = msgspec.json.decode(args.prefill_prefix, type=list[str])
        results.append(asyncio.run(bench_layout(cfg, args.reps, seed=0, prefill_prefix=prefix)))
        if not args.json:
            print(results[-1], file=sys.stderr)
    out.write(msgspec.json.encode(results) + b"\n")
    out.flush()


if __name__ == "__main__":
    main()
