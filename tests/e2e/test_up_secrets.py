"""``pdserve up`` given its secrets in files: none of them reaches a command line (its own, or
any child's, read from ``/proc/PID/cmdline`` where ``ps`` reads them), and both keys work."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.deployment import UpProcess

pytestmark = pytest.mark.slow
API_KEY = "sk-api-secret-5a1b2c3d4e"
ADMIN_KEY = "admin-secret-9f8e7d6c5b"


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        queue += children.get(current, [])
    return found


def _secret_file(path: Path, value: str) -> str:
    path.write_text(value + "\n")
    path.chmod(0o600)
    return str(path)


def _drain(endpoint: str, key_file: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", "drain", "--endpoint", endpoint, "--admin-key-file", key_file],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_") or k == "PDSERVE_STATE_DIR"},
    )


def test_up_keeps_keys_given_in_files_off_every_command_line_and_they_work(checkpoints, tmp_path):
    path, _ = checkpoints("llama")
    up = UpProcess(
        "up",
        "--model",
        str(path),
        "--port",
        "0",
        "--http-port",
        "0",
        "--prefill",
        "0",
        "--disaggregation",
        "off",
        "--threads-per-worker",
        "1",
        "--api-key-file",
        _secret_file(tmp_path / "api-keys", API_KEY),
        "--admin-key-file",
        _secret_file(tmp_path / "admin-key", ADMIN_KEY),
        "--insecure",  # the admin key guards Drain where no cluster certificate does
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")},
            "TMPDIR": str(tmp_path),
            "PDSERVE_STATE_DIR": os.environ["PDSERVE_STATE_DIR"],
        },
    )
    try:
        up_line, _ = up.wait_up()
        pids = _descendants(up.process.pid)
        command_lines = {}
        for pid in pids:
            try:
                command_lines[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
        assert sum("pdserve" in line for line in command_lines.values()) >= 3, command_lines  # up, frontend, worker
        for pid, line in command_lines.items():
            assert API_KEY not in line and ADMIN_KEY not in line, f"a secret on process {pid}'s command line: {line}"
        assert API_KEY not in up.output and ADMIN_KEY not in up.output  # nor in any log line

        base_url = re.search(r"OpenAI API on (http://\S+/v1);", up_line).group(1)
        models = urllib.request.Request(f"{base_url}/models", headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(models, timeout=10) as answer:
            assert answer.status == 200
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{base_url}/models", timeout=10)
        assert refused.value.code == 401

        endpoint = re.search(r"decode worker \S+ listening on (\S+)", up.output).group(1)
        wrong = _drain(endpoint, _secret_file(tmp_path / "wrong-admin-key", "not-the-admin-key"))
        assert wrong.returncode == 1 and "PERMISSION_DENIED" in wrong.stderr
        drained = _drain(endpoint, str(tmp_path / "admin-key"))
        assert drained.returncode == 0, drained.stderr
        up.process.send_signal(signal.SIGINT)
        assert up.process.wait(60) == 0, up.output
    finally:
        up.close()
