"""The metrics port's probes as the kubelet sees them: 200 ``ok`` or 503 with the reason, beside
an unchanged ``/metrics``; and a check that hops onto an event loop, answered or blocked."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request

from pdserve.observability.metrics import FrontendMetrics
from pdserve.observability.probes import MetricsServer, Probes, on_loop


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_probes_answer_their_checks_and_metrics_stay_as_they_were():
    reasons: dict[str, str | None] = {"ready": "not registered", "live": None}
    metrics = FrontendMetrics(lambda: 3)
    server = MetricsServer.start(
        metrics.registry, "127.0.0.1", 0, Probes(lambda: reasons["ready"], lambda: reasons["live"])
    )
    try:
        assert _get(server.port, "/readyz") == (503, "not registered\n")
        assert _get(server.port, "/livez") == (200, "ok\n")
        reasons["ready"], reasons["live"] = None, "engine thread: no progress for 61.0s (deadline 60s)"
        assert _get(server.port, "/readyz") == (200, "ok\n")
        assert _get(server.port, "/livez") == (503, "engine thread: no progress for 61.0s (deadline 60s)\n")
        status, text = _get(server.port, "/metrics")
        assert status == 200 and "pdserve_queue_length 3.0" in text
    finally:
        server.close()


def test_a_check_that_raises_is_a_failed_probe():
    def broken() -> str | None:
        raise KeyError("gone")

    server = MetricsServer.start(FrontendMetrics(lambda: 0).registry, "127.0.0.1", 0, Probes(broken, broken))
    try:
        status, text = _get(server.port, "/livez")
        assert status == 503 and text.startswith("check failed: KeyError")
    finally:
        server.close()


def test_on_loop_answers_from_a_running_loop_and_times_out_on_a_blocked_one():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:
        assert on_loop(loop, lambda: None, 2.0) is None
        assert on_loop(loop, lambda: "draining", 2.0) == "draining"
        loop.call_soon_threadsafe(time.sleep, 1.5)  # a real blocking call on the loop's thread
        time.sleep(0.1)
        assert on_loop(loop, lambda: None, 0.5) == "event loop did not answer within 0.5s"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
    assert on_loop(loop, lambda: None, 0.5) == "event loop closed"
