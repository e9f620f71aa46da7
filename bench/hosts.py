"""What crossing hosts costs: a KV pull and a small gloo all_reduce between two hosts against
within one host, side by side in one run.

The hosts are ``bench.lib.hosts``'s (network namespaces on a veth pair, each with its own
address, loopback and /dev/shm; needs CAP_SYS_ADMIN and CAP_NET_ADMIN). Across: the two
processes run on hosts 0 and 1 and meet at host 0's address. Within: both run on host 0, the
pull as ``bench.kv_transfer`` runs it, the all_reduce over 127.0.0.1 (``lo``) as a one-host
rank group does.

- KV pull: ``bench.kv_transfer`` itself, one request's blocks (``--tokens``) of each layout,
  its prefill child started on the other host (``--prefill-prefix``).
- all_reduce: two gloo ranks (``--role rank``) with GLOO_SOCKET_IFNAME set, the median time of
  ``--reps`` calls at each size, after a warm-up.

    python -m bench.hosts --json
    python -m bench.hosts --json --layouts smollm2-135m --tokens 64 --reps 2 --sizes 4096  # tiny

prints one JSON object: machine, kv (one object per layout: layout, tokens, bytes, then
scattered and contiguous GB/s across and within, and across / within), all_reduce (one
object per size: bytes, across_us, within_us, across_over_within).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.lib.hosts import Host, Hosts, unavailable
from bench.lib.machine import describe
from bench.lib.report import emit, median, ratio

ROOT = Path(__file__).resolve().parents[1]
STORE_PORT = 29500
TIMEOUT_S = 300


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), **extra)


def _kv_pull(runner: Host, prefill: Host | None, layout: str, tokens: int, reps: int) -> dict:
    argv = [sys.executable, "-m", "bench.kv_transfer", "--json", "--layouts", layout, "--tokens", str(tokens)]
    argv += ["--reps", str(reps)]
    if prefill is not None:
        argv += ["--prefill-prefix", json.dumps(prefill.enter_argv(str(ROOT)))]
    done = runner.run(argv, timeout=TIMEOUT_S, env=_env(), cwd=str(ROOT))
    if done.returncode:
        raise RuntimeError(f"bench.kv_transfer failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)[0]


def kv_rows(hosts: Hosts, layouts: list[str], tokens: int, reps: int) -> list[dict]:
    rows = []
    for layout in layouts:
        across = _kv_pull(hosts[1], hosts[0], layout, tokens, reps)
        within = _kv_pull(hosts[0], None, layout, tokens, reps)
        rows.append(
            {
                "layout": layout,
                "tokens": tokens,
                "bytes": across["bytes"],
                "across_scattered_gbps": across["scattered_gbps"],
                "within_scattered_gbps": within["scattered_gbps"],
                "across_contiguous_gbps": across["contiguous_gbps"],
                "within_contiguous_gbps": within["contiguous_gbps"],
                "across_over_within": ratio(across["scattered_gbps"], within["scattered_gbps"]),
            }
        )
    return rows


def _all_reduce_us(placement: list[Host], address: str, ifname: str, sizes: list[int], reps: int) -> dict[int, float]:
    """Median microseconds per all_reduce at each size, ranks on ``placement``, as rank 0 measured."""
    ranks = []
    for rank, host in enumerate(placement):
        argv = [sys.executable, "-m", "bench.hosts", "--role", "rank", "--address", address, "--rank", str(rank)]
        argv += ["--sizes", ",".join(map(str, sizes)), "--reps", str(reps)]
        env = _env(GLOO_SOCKET_IFNAME=ifname)
        ranks.append(host.popen(argv, env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = []
    for proc in ranks:
        out, err = proc.communicate(timeout=TIMEOUT_S)
        if proc.returncode:
            raise RuntimeError(f"all_reduce rank failed: {err.decode()[-2000:]}")
        outputs.append(out)
    return {int(k): v for k, v in json.loads(outputs[0]).items()}


def all_reduce_rows(hosts: Hosts, sizes: list[int], reps: int) -> list[dict]:
    across = _all_reduce_us([hosts[0], hosts[1]], hosts[0].address, hosts[0].interface, sizes, reps)
    within = _all_reduce_us([hosts[0], hosts[0]], "127.0.0.1", "lo", sizes, reps)
    return [
        {
            "bytes": size,
            "across_us": across[size],
            "within_us": within[size],
            "across_over_within": ratio(across[size], within[size]),
        }
        for size in sizes
    ]


def rank_main(address: str, rank: int, sizes: list[int], reps: int) -> dict[int, float]:
    """One rank of the pair: the median microseconds of ``reps`` all_reduces of each size (float32)."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore(address, STORE_PORT, 2, rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    result = {}
    for size in sizes:
        tensor = torch.ones(size // 4)
        for _ in range(3):
            dist.all_reduce(tensor)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append((time.perf_counter() - start) * 1e6)
        result[size] = median(times, 1)
    dist.destroy_process_group()
    return result


def _table(report: dict) -> None:
    for row in report["kv"]:
        print(
            f"KV pull {row['layout']} {row['tokens']} tokens ({row['bytes'] / 2**20:.1f} MiB): across "
            f"{row['across_scattered_gbps']} GB/s, within {row['within_scattered_gbps']} GB/s "
            f"(x{row['across_over_within']})"
        )
    for row in report["all_reduce"]:
        print(
            f"all_reduce {row['bytes']} B: across {row['across_us']} us, within {row['within_us']} us "
            f"(x{row['across_over_within']})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the only output)")
    parser.add_argument("--layouts", default="smollm2-135m,llama-3.1-8b", help="bench.kv_transfer layouts")
    parser.add_argument("--tokens", type=int, default=4096, help="the request's tokens (whole blocks)")
    parser.add_argument("--kv-reps", type=int, default=10, help="measured pulls per layout and placement")
    parser.add_argument("--sizes", default="4096,1048576", help="all_reduce sizes in bytes, comma-separated")
    parser.add_argument("--reps", type=int, default=200, help="timed all_reduces per size and placement")
    parser.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(s < 4 or s % 4 for s in sizes):
        parser.error(f"--sizes must be positive multiples of 4 bytes, got {args.sizes}")
    if args.role == "rank":
        print(json.dumps(rank_main(args.address, args.rank, sizes, args.reps)), flush=True)
        return
    reason = unavailable()
    if reason is not None:
        parser.error(f"cannot make separate hosts here: {reason}")
    with Hosts(2) as hosts:
        report = {
            "machine": describe(),
            "kv": kv_rows(hosts, args.layouts.split(","), args.tokens, args.kv_reps),
            "all_reduce": all_reduce_rows(hosts, sizes, args.reps),
        }
    emit(report, args.json, _table)


if __name__ == "__main__":
    main()
