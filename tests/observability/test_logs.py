"""Logging as ``--log-format json`` sets it up: one JSON object a line, with its context, from a
real worker process as much as in-process."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

import pytest

from pdserve.observability import logs


@pytest.fixture
def restore_logging():
    yield
    logs.configure("warning", "text")


def test_json_lines_carry_time_level_logger_message_and_context(capsys, restore_logging):
    logs.configure("info", "json")
    logs.bind(worker_id="decode-w1")
    log = logging.getLogger("pdserve.test")
    log.debug("below the level")
    log.info("admitted %s", "r1", extra={"request_id": "r1"})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(e["level"], e["logger"], e["message"]) for e in lines] == [
        ("INFO", "pdserve.test", "admitted r1"),
        ("ERROR", "pdserve.test", "failed"),
    ]
    assert lines[0]["request_id"] == "r1" and "request_id" not in lines[1]
    assert all(e["worker_id"] == "decode-w1" and e["time"].endswith("+00:00") for e in lines)
    assert "RuntimeError: boom" in lines[1]["exception"]


def test_a_bad_level_or_format_is_refused_naming_it():
    with pytest.raises(ValueError, match="log level"):
        logs.configure("loud", "text")
    with pytest.raises(ValueError, match="log format"):
        logs.configure("info", "xml")


@pytest.mark.slow
def test_a_worker_with_log_format_json_writes_only_json_lines(checkpoints, etcd_url):
    path, _ = checkpoints("llama")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    worker = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "decode", "--model", str(path), "--etcd", etcd_url, "--port", "0"]
        + ["--metrics-port", "-1", "--num-threads", "1", "--log-format", "json", "--log-level", "info"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert worker.stdout is not None
        for line in worker.stdout:  # its own lines (progress, the ready line) go to stdout
            if "listening on" in line:
                break
        else:
            pytest.fail(f"the worker exited with {worker.wait()} before listening")
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    lines = err.splitlines()
    assert lines, "the worker logged nothing at info"
    entries = [json.loads(line) for line in lines]  # every line parses
    assert all({"time", "level", "logger", "message"} <= set(e) for e in entries)
    assert any(e.get("worker_id") for e in entries)  # named once it is known
