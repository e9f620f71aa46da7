"""A real frontend process's probes: /readyz turns 200 only once a worker of each pool its
disaggregation needs is registered in a real etcd (decode, and prefill under ``always``), and
503 again when one leaves; /livez answers while its event loop does."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from pdserve.discovery.etcd import EtcdConnection
from pdserve.discovery.registration import WorkerRegistration
from pdserve.discovery.registry import Role, WorkerEntry
from pdserve.types.engine_load import EngineLoad
from tests.utils.aio import run_scenario


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode().strip()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode().strip()


def _entry(role: Role, worker_id: str) -> WorkerEntry:
    return WorkerEntry(
        worker_id=worker_id,
        role=role,
        model="health-model",
        model_path="/nowhere",
        endpoint="127.0.0.1:1",
        nixl=b"",
        block_size=4,
        num_kv_blocks=64,
        max_model_len=256,
        vocab_size=100,
        max_num_seqs=4,
        started_at=time.time(),
    )


@pytest.mark.slow
def test_frontend_is_ready_once_a_worker_of_each_needed_pool_is_registered(etcd_server):
    frontend = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "frontend", "--etcd", etcd_server.url, "--port", "0",
         "--http-port", "-1", "--metrics-port", "0", "--disaggregation", "always"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert frontend.stdout is not None
        port = None
        for line in frontend.stdout:
            if found := re.search(r"metrics on http://[^:]+:(\d+)/metrics", line):
                port = int(found.group(1))
            if "listening on" in line:
                break
        assert port is not None, f"frontend exited with {frontend.poll()}"
        assert _get(port, "/livez") == (200, "ok")
        assert _get(port, "/readyz") == (503, "no serving decode or prefill worker")

        async def scenario() -> list[tuple[int, str]]:
            async def answer_when(want: tuple[int, str]) -> tuple[int, str]:
                for _ in range(100):  # the view sees a registration within milliseconds
                    answer = await asyncio.to_thread(_get, port, "/readyz")
                    if answer == want:
                        break
                    await asyncio.sleep(0.05)
                return answer

            etcd = EtcdConnection(etcd_server.url)
            decode = WorkerRegistration(etcd, _entry(Role.DECODE, "decode-h"), EngineLoad)
            prefill = WorkerRegistration(etcd, _entry(Role.PREFILL, "prefill-h"), EngineLoad)
            answers = []
            try:
                await decode.start()
                await asyncio.sleep(0.5)  # time enough for the view to have seen it
                answers.append(await asyncio.to_thread(_get, port, "/readyz"))
                await prefill.start()
                answers.append(await answer_when((200, "ok")))
                await decode.close()
                answers.append(await answer_when((503, "no serving decode worker")))
            finally:
                await decode.close()
                await prefill.close()
                await etcd.close()
            return answers

        assert run_scenario(scenario()) == [
            (503, "no serving prefill worker"),
            (200, "ok"),
            (503, "no serving decode worker"),
        ]
    finally:
        frontend.terminate()
        frontend.wait(30)
