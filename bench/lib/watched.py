"""A child process whose output is read as it comes, on a thread of its own, and kept.

A pipe nobody reads blocks its writer once full; a server's "listening on" line is what a bench
or a test waits for. ``Watched`` owns the reading thread (a daemon that ends with the pipe); the
caller owns the process and stops it.
"""

from __future__ import annotations

import subprocess
import threading


class Watched:
    """``process`` (started with ``stdout=PIPE, text=True``): its lines in ``lines``, and
    ``listening`` set at the first line that contains ``marker``."""

    def __init__(self, process: subprocess.Popen, marker: str = "listening on") -> None:
        self.process = process
        self.marker = marker
        self.lines: list[str] = []
        self.listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None, "start the process with stdout=subprocess.PIPE"
        for line in self.process.stdout:
            self.lines.append(line)
            if self.marker in line:
                self.listening.set()

    def wait_listening(self, timeout_s: float) -> bool:
        """Whether the marker came within ``timeout_s``."""
        return self.listening.wait(timeout_s)

    def tail(self, count: int = 30) -> str:
        return "".join(self.lines[-count:])
