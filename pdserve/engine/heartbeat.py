"""A loop's sign of life, read from another thread: the loop beats each time round, a reader
asks how long ago the last beat was.

The engine thread beats once its warm-up is done, before and after every step, and on every
wake of its idle waits (at most ``EngineLoop``'s ``idle_wait_s``, or one second, apart), so an
idle engine stays live. A step is one beat interval: a step that runs longer than a reader's
deadline reads as stalled, so the deadline must exceed the longest legitimate step. Imports
nothing but the standard library.
"""

from __future__ import annotations

import time


class Heartbeat:
    """The monotonic time of the last ``beat()``; a float's assignment is atomic, so no lock."""

    def __init__(self) -> None:
        self._last: float | None = None

    def beat(self) -> None:
        self._last = time.monotonic()

    @property
    def has_beaten(self) -> bool:
        return self._last is not None

    def age_s(self) -> float | None:
        """Seconds since the last beat; None before the first."""
        last = self._last
        return None if last is None else time.monotonic() - last

    def stall(self, deadline_s: float) -> str | None:
        """Why the loop is not live (no beat yet, or none for more than ``deadline_s``); None while it is."""
        age = self.age_s()
        if age is None:
            return "not started"
        if age > deadline_s:
            return f"no progress for {age:.1f}s (deadline {deadline_s:g}s)"
        return None
