"""The expert-parallel all-to-all on its own: dispatch and combine at DeepSeek-V3 shapes.

    torchrun --nproc-per-node 8 -m bench.all_to_all [--json]        # a GPU node: NCCL
    torchrun --standalone --nproc-per-node 2 -m bench.all_to_all --smoke --json  # CPU, gloo: checks it

Each rank routes its tokens to ``--top-k`` of ``--experts`` experts spread evenly over the
ranks (uniform random routing: the balanced case; skew only makes the busiest link slower),
then times the exchanges a ``MoE`` layer makes across data-parallel ranks through
``ParallelState``: the split counts, the rows and their slot ids out (dispatch), and the
expert outputs back (combine). It reports the median of each, and the bytes each rank sends
to other ranks per exchange, as GB/s against the time: compare with the node's NVLink
(or the NIC's) bandwidth per GPU. The expert compute between them is ``bench/kernels.py``'s.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from bench.lib.report import emit, median
from pdserve.distributed.parallel_config import ParallelConfig
from pdserve.distributed.parallel_state import ParallelState


class RankTiming(msgspec.Struct, frozen=True):
    counts_ms: float
    dispatch_rows_ms: float
    dispatch_ids_ms: float
    combine_ms: float
    off_rank_bytes: int


def _time_ms(fn, device: str, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: 128; --smoke 16)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default: 7168; --smoke 64)")
    parser.add_argument("--experts", type=int, default=256, help="routed experts (default: 256)")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token (default: 8)")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs of each exchange (default: 20)")
    parser.add_argument("--smoke", action="store_true", help="gloo on CPU, tiny shapes: only to check the script")
    parser.add_argument("--json", action="store_true", help="print one JSON object (rank 0) instead of a table")
    args = parser.parse_args()
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    tokens = args.tokens or (16 if args.smoke else 128)
    hidden = args.hidden or (64 if args.smoke else 7168)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(seconds=120))
    config = ParallelConfig(data_parallel_size=world, enable_expert_parallel=True)
    parallel = ParallelState(rank=rank, config=config, ep_group=dist.group.WORLD, dp_group=dist.group.WORLD)

    per_rank = args.experts // world
    generator = torch.Generator().manual_seed(rank)
    expert_ids = torch.stack([torch.randperm(args.experts, generator=generator)[: args.top_k] for _ in range(tokens)])
    owner = (expert_ids // per_rank).flatten()
    order = torch.argsort(owner, stable=True)
    send_counts = torch.bincount(owner, minlength=world).tolist()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = torch.randn(tokens * args.top_k, hidden, device=device).to(dtype)[order.to(device)]
    slot_ids = (expert_ids.flatten()[order] % per_rank).unsqueeze(1).to(device)
    received, recv_counts = parallel.ep_all_to_all(rows, send_counts)

    timings = {
        "counts_ms": _time_ms(lambda: parallel.ep_all_to_all(slot_ids[:0], [0] * world), device, args.repeats),
        "dispatch_rows_ms": _time_ms(
            lambda: parallel.ep_all_to_all(rows, send_counts, recv_counts), device, args.repeats
        ),
        "dispatch_ids_ms": _time_ms(
            lambda: parallel.ep_all_to_all(slot_ids, send_counts, recv_counts), device, args.repeats
        ),
        "combine_ms": _time_ms(
            lambda: parallel.ep_all_to_all_back(received, recv_counts, send_counts), device, args.repeats
        ),
    }
    off_rank_bytes = (sum(send_counts) - send_counts[rank]) * hidden * rows.element_size()
    mine = RankTiming(**timings, off_rank_bytes=off_rank_bytes)
    gathered = [msgspec.structs.asdict(t) for t in parallel.gather_to_driver(mine, RankTiming) or []]
    dist.destroy_process_group()
    if rank != 0:
        return
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (gloo smoke run)",
        "world_size": world,
        "tokens_per_rank": tokens,
        "hidden": hidden,
        "experts": args.experts,
        "top_k": args.top_k,
        "dtype": str(dtype).removeprefix("torch."),
        "median_over_ranks": {k: median((g[k] for g in gathered), 4) for k in timings},
        "slowest_rank": {k: round(max(g[k] for g in gathered), 4) for k in timings},
        # Four significant digits: the smoke run's few kilobytes are thousandths of a GB/s.
        "dispatch_gbps_per_rank": float(
            f"{median(g['off_rank_bytes'] / g['dispatch_rows_ms'] / 1e6 for g in gathered):.4g}"
        ),
    }
    emit(report, args.json, _print_lines)


def _print_lines(report: dict) -> None:
    for key, value in report.items():
        print(f"{key:24} {value}")


if __name__ == "__main__":
    main()
