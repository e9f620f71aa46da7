"""How much prompt text the frontend tokenizes at once, in characters, across all requests.

Tokenizing takes memory in proportion to the text: three prompts of 4.2 M characters took a
frontend from 334 MB to 2.7 GB, about 190 bytes a character at the peak. A ``CharBudget``
bounds the sum: a prompt waits, first come first served, until its characters fit beside
those being tokenized, and is refused (``Busy``) if they do not fit within ``wait_s``. A
prompt larger than the whole budget is charged the whole budget: it runs alone.

Contract: ``acquire`` returns the charge to hand back to ``release`` exactly once, when the
tokenization is over (not when its caller left: the thread runs on). Nothing is held after
``acquire`` raises. Imports nothing but asyncio.
"""

from __future__ import annotations

import asyncio
from collections import deque

# How long a prompt waits for room: about what the default budget (2 Mi characters) takes to
# tokenize, as 4.2 M characters took ~11 s.
TOKENIZE_WAIT_S = 10.0


class Busy(RuntimeError):
    """The budget stayed full for as long as the request could wait; retry later."""


class CharBudget:
    """Attributes:
    max_chars: the most characters being tokenized at once.
    wait_s: how long a prompt waits for room before it is refused.
    """

    def __init__(self, max_chars: int, wait_s: float) -> None:
        self.max_chars = max_chars
        self.wait_s = wait_s
        self.in_use = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()  # oldest first

    async def acquire(self, num_chars: int) -> int:
        """Room for ``num_chars``; returns the charge for ``release``. Raises Busy after ``wait_s``."""
        charge = min(num_chars, self.max_chars)
        if not self._waiters and self.in_use + charge <= self.max_chars:
            self.in_use += charge
            return charge
        entry = (charge, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(entry[1]), self.wait_s)
        except BaseException as exc:
            if entry[1].done():  # granted as the wait ended: give it back
                self.release(charge)
            else:
                self._waiters.remove(entry)
                self._grant()  # a large prompt leaving may let smaller ones behind it go
            if isinstance(exc, TimeoutError):
                raise Busy(
                    f"{self.in_use} prompt characters are being tokenized; the limit (max_tokenizing_chars) is "
                    f"{self.max_chars}, and {num_chars} more did not fit within {self.wait_s:g} s; retry later"
                ) from None
            raise
        return charge

    def release(self, charge: int) -> None:
        """Give back what ``acquire`` returned: the tokenization is over."""
        self.in_use -= charge
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.in_use + self._waiters[0][0] <= self.max_chars:
            charge, waiter = self._waiters.popleft()
            self.in_use += charge
            waiter.set_result(None)
