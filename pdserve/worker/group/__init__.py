"""A serving worker's tensor-parallel group: ranks 1..N-1 and the KV side channel to them.

- ``leader``: rank 0's side (``WorkerGroup``): starts the ranks, holds its link to them, closes them;
- ``link``: rank 0's end of the side channel (``GroupLink``): hellos, pull orders, notices;
- ``messages``: what rank 0 and the other ranks tell each other over the link, framed msgspec;
- ``pull``: a decode group's pull (``GroupPuller``): every rank reads its own heads;
- ``sent``: a prefill group's "sent" (``GroupSent``): a pin is freed once every rank reports;
- ``rank_main``: the program of ranks 1..N-1 (``python -m pdserve.worker.group.rank_main``);
- ``rank_service``: a rank's NIXL agent driven by rank 0's link (``RankService``), on its KV thread.
"""
