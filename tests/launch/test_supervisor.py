"""The supervisor's policy with real (tiny) processes: restarts back off doubling, a crash loop
is given up on and counted, a clean exit can be final, and release stops a restart under way."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from pdserve.launch.child import ChildFailed
from pdserve.launch.supervisor import RestartPolicy, Supervisor
from pdserve.observability.metrics import SupervisorMetrics
from tests.utils.aio import run_scenario


class Crasher:
    """A process that exits with ``code`` after ``life_s``; ``fail_starts`` starts fail first."""

    role = "decode"

    def __init__(self, name: str, code: int = 3, life_s: float = 0.0, fail_starts: int = 0) -> None:
        self.name = name
        self.code = code
        self.life_s = life_s
        self.fail_starts = fail_starts
        self.starts: list[float] = []
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.starts.append(time.monotonic())
        if self.fail_starts:
            self.fail_starts -= 1
            raise ChildFailed(f"{self.name} exited; its last output: bad config")
        code = f"import sys, time; time.sleep({self.life_s}); sys.exit({self.code})"
        self.process = await asyncio.create_subprocess_exec(sys.executable, "-c", code)

    async def wait(self) -> int:
        assert self.process is not None
        return await self.process.wait()


def _value(metrics: SupervisorMetrics, name: str, child: str) -> float:
    return metrics.registry.get_sample_value(f"{name}_total", {"child": child, "role": "decode"}) or 0.0


def test_restarts_back_off_doubling_then_it_gives_up(caplog: pytest.LogCaptureFixture) -> None:
    metrics = SupervisorMetrics()
    given_up: list[tuple[str, str]] = []

    async def body() -> Crasher:
        supervisor = Supervisor(
            RestartPolicy(max_restarts=3, min_backoff_s=0.2, max_backoff_s=0.5),
            metrics,
            lambda child, why: given_up.append((child.name, why)),
        )
        child = Crasher("decode-1")
        await child.start()
        child.fail_starts = 1  # the first restart fails to start: that counts as a crash too
        supervisor.watch(child)
        deadline = time.monotonic() + 20
        while not given_up and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await supervisor.close()
        return child

    child = run_scenario(body())
    assert given_up == [("decode-1", "exited with status 3")]
    gaps = [b - a for a, b in zip(child.starts, child.starts[1:])]
    # Back-offs 0.2, 0.4, 0.5 (capped) before restarts 1..3; the first and third also wait out
    # the short life of the process before them, the second follows the failed start at once.
    assert len(gaps) == 3 and gaps[0] >= 0.2 and 0.4 <= gaps[1] < 1.0 and 0.5 <= gaps[2] < 3, gaps
    assert _value(metrics, "pdserve_child_restarts", "decode-1") == 3
    assert _value(metrics, "pdserve_child_crashes", "decode-1") == 4
    assert _value(metrics, "pdserve_child_gave_up", "decode-1") == 1
    assert "giving up on it after 3 restarts in a row" in caplog.text


def test_a_child_up_long_enough_starts_its_count_afresh() -> None:
    metrics = SupervisorMetrics()
    given_up: list[str] = []

    async def body() -> Crasher:
        supervisor = Supervisor(
            RestartPolicy(max_restarts=1, min_backoff_s=0.05, reset_after_s=0.3),
            metrics,
            lambda child, why: given_up.append(child.name),
        )
        child = Crasher("decode-2", life_s=0.5)  # each life is past reset_after_s
        await child.start()
        supervisor.watch(child)
        while len(child.starts) < 4 and not given_up:
            await asyncio.sleep(0.05)
        await supervisor.close()
        return child

    run_scenario(body(), timeout_s=30)
    assert given_up == [], "a child that stayed up was given up on after max_restarts=1"


def test_a_clean_exit_can_be_final_and_release_cancels_a_restart() -> None:
    metrics = SupervisorMetrics()
    done: list[str] = []

    async def body() -> tuple[Crasher, Crasher]:
        supervisor = Supervisor(
            RestartPolicy(min_backoff_s=5.0, max_backoff_s=5.0),
            metrics,
            lambda child, why: done.append(f"{child.name} {why}"),
            is_done=lambda child, code: code == 0,
        )
        drained = Crasher("decode-3", code=0)
        crashed = Crasher("decode-4")
        for child in (drained, crashed):
            await child.start()
            supervisor.watch(child)
        await asyncio.sleep(1.0)  # decode-4 now waits out its 5 s back-off
        started = time.monotonic()
        await supervisor.release(crashed)
        assert time.monotonic() - started < 1.0
        await supervisor.close()
        return drained, crashed

    drained, crashed = run_scenario(body())
    assert done == ["decode-3 exited with status 0"]
    assert len(drained.starts) == 1 and len(crashed.starts) == 1  # neither was restarted
    assert _value(metrics, "pdserve_child_crashes", "decode-3") == 0
