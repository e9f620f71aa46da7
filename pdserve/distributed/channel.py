"""Rank 0's ordered messages to the rest of its group, over the group's TCP store.

Step plans and offline commands go this way rather than through a collective: a rank waiting
for the next message may wait as long as its owner is idle (a server with no requests), which
a collective's timeout would forbid. The wait is a loop of short store waits, so a rank whose
owner is gone notices (its parent-watch exits it) instead of hanging.

Messages are msgspec structs, numbered; rank 0 deletes message n-2 as it sends message n. That
is safe because every message is followed by a collective of the whole group (a step's
all-reduces, a gather) before the next one is sent: by then every rank has read it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TypeVar

import msgspec
import torch.distributed as dist

from pdserve.distributed.errors import RankFailed

_PREFIX = "pdserve/channel/"
_POLL = timedelta(seconds=1)

S = TypeVar("S", bound=msgspec.Struct)


class Channel:
    """One per rank; ``send`` on rank 0, ``receive`` on the others, in the same order."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self._seq = 0

    def send(self, message: msgspec.Struct) -> None:
        self._seq += 1
        # torch's stub types the value as str; the store takes bytes as they are.
        self.store.set(f"{_PREFIX}{self._seq}", msgspec.msgpack.encode(message))  # type: ignore[arg-type]
        if self._seq > 2:
            self.store.delete_key(f"{_PREFIX}{self._seq - 2}")

    def receive(self, type_: type[S]) -> S:
        self._seq += 1
        key = f"{_PREFIX}{self._seq}"
        while True:
            try:
                self.store.wait([key], _POLL)
                break
            except RuntimeError as error:
                if "timeout" not in str(error).lower():  # not idle: the store, so rank 0, is gone
                    raise RankFailed(f"rank 0 is gone: the group's store closed ({error})") from error
        return msgspec.msgpack.decode(self.store.get(key), type=type_)
