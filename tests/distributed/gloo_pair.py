"""One rank of a two-rank gloo group (``python -m tests.distributed.gloo_pair ADDRESS RANK``):
meets at a TCPStore that rank 0 serves on ADDRESS:29500, runs ``init_process_group`` and one
all_reduce of ``rank + 1``, and prints the sum. Deadlines: 10 s each for the store and the group."""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

PORT = 29500
TIMEOUT = datetime.timedelta(seconds=10)


def main() -> None:
    address, rank = sys.argv[1], int(sys.argv[2])
    store = dist.TCPStore(address, PORT, 2, rank == 0, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=TIMEOUT)
    value = torch.full((1024,), float(rank + 1))
    dist.all_reduce(value)
    print(int(value[0]), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
