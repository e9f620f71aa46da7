"""``pdserve top`` as an operator watches it: in a real terminal (a tmux pane), beside a real
``pdserve up``, found through the state directory with no options, quit with ``q``."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from tests.e2e.deployment import UpProcess

pytestmark = pytest.mark.slow


def _wait_for(read: Callable[[], str], done: Callable[[str], bool], what: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    text = read()
    while not done(text):
        assert time.monotonic() < deadline, f"no {what} within {timeout:g}s; last screen:\n{text}"
        time.sleep(0.25)
        text = read()
    return text


def _frame(screen: str) -> int:
    found = re.search(r"· frame (\d+) ·", screen)
    return int(found.group(1)) if found else 0


def test_top_shows_both_pools_refreshes_and_quits_on_q(checkpoints, tmp_path) -> None:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (scripts/setup.sh installs it): this test drives `pdserve top` in a pane")
    path, _ = checkpoints("llama")
    up = UpProcess(
        "up",
        "--model",
        str(path),
        "--port",
        "0",
        "--disaggregation",
        "always",
        "--threads-per-worker",
        "1",
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    # A tmux server of the test's own, started with the test's environment ($PDSERVE_STATE_DIR).
    tmux = ["tmux", "-L", f"pdserve-top-{os.getpid()}"]
    exit_file = tmp_path / "top.exit"
    try:
        up.wait_up()
        command = f"{shlex.quote(sys.executable)} -m pdserve top; echo $? > {shlex.quote(str(exit_file))}"
        subprocess.run([*tmux, "new-session", "-d", "-s", "top", "-x", "160", "-y", "50", command], check=True)

        def pane() -> str:
            return subprocess.run([*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True).stdout

        screen = _wait_for(pane, lambda s: "PREFILL pool: 1 ready" in s and "DECODE pool: 1 ready" in s, "both pools")
        rows = {line.split()[0].split("-")[0]: line.split() for line in screen.splitlines() if "ready" in line.split()}
        assert set(rows) == {"prefill", "decode"}, screen
        # Each row is whole: the registry's load and the worker's own /metrics (hit rate, preemptions).
        assert all("?" not in row for row in rows.values()), screen
        assert "migrations: 0 in all" in screen and "NO ANSWER" not in screen, screen
        first = _frame(screen)
        _wait_for(pane, lambda s: _frame(s) >= first + 2, "refresh")

        subprocess.run([*tmux, "send-keys", "-t", "top", "q"], check=True)
        _wait_for(lambda: exit_file.read_text() if exit_file.exists() else "", lambda s: s.endswith("\n"), "exit", 20)
        assert exit_file.read_text().strip() == "0"
        # The terminal is back: the main screen, not top's frame.
        assert "· frame" not in pane()
        up.process.send_signal(signal.SIGINT)
        assert up.process.wait(60) == 0, up.output
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        up.close()
