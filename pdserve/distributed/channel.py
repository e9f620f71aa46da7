"""A leader rank's ordered messages to the ranks it leads, over the group's TCP store.

Two channels run over one store, each with its own keys: a tensor-parallel leader's step plans
to its tensor-parallel ranks (one channel per data-parallel rank), and rank 0's commands to the
data-parallel leaders (an offline ``LLM``'s prompts).

Step plans and offline commands go this way rather than through a collective: a rank waiting
for the next message may wait as long as its owner is idle (a server with no requests), which
a collective's timeout would forbid. The wait is a loop of short store waits, so a rank whose
owner is gone notices (its parent-watch exits it) instead of hanging.

Messages are msgspec structs, numbered; the leader deletes message n-2 as it sends message n.
That is safe because every message is followed by a collective of all its readers (a step's
all-reduces, a gather) before the next one is sent: by then every reader has read it.
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
    """One per rank and channel name; ``send`` on the leader, ``receive`` on the others, in the
    same order."""

    def __init__(self, store: dist.Store, name: str) -> None:
        self.store = store
        self._prefix = f"{_PREFIX}{name}/"
        self._seq = 0

    def send(self, message: msgspec.Struct) -> None:
        self._seq += 1
        # torch's stub types the value as str; the store takes bytes as they are.
        self.store.set(f"{self._prefix}{self._seq}", msgspec.msgpack.encode(message))  # type: ignore[arg-type]
        if self._seq > 2:
            self.store.delete_key(f"{self._prefix}{self._seq - 2}")

    def receive(self, type_: type[S]) -> S:
        self._seq += 1
        key = f"{self._prefix}{self._seq}"
        while True:
            try:
                self.store.wait([key], _POLL)
                break
            except RuntimeError as error:
                if "timeout" not in str(error).lower():  # not idle: the store, so rank 0, is gone
                    raise RankFailed(f"the leader is gone: the group's store closed ({error})") from error
        return msgspec.msgpack.decode(self.store.get(key), type=type_)
