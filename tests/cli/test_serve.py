"""``pdserve prefill|decode|frontend``: the options fill ``WorkerConfig`` / ``FrontendConfig``
(whose defaults are the only ones), or ``--config FILE`` gives the whole struct, as
``pdserve up`` does for its children."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest

from pdserve.cli import build_parser
from pdserve.cli.common import field_default
from pdserve.cli.frontend_args import frontend_config
from pdserve.cli.serve import worker_config
from pdserve.discovery.etcd import close_quietly, connect
from pdserve.distributed.parallel_config import ParallelConfig
from pdserve.frontend.config import FrontendConfig, RouterConfig
from pdserve.observability.frontend_stats import FrontendStats, list_frontend_stats
from pdserve.types.engine_config import EngineConfig
from pdserve.worker.config import WorkerConfig
from tests.e2e.deployment import bound_port


def _parse(*argv: str):
    return build_parser().parse_args(list(argv))


def _pdserve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_ETCD"}
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_a_worker_given_no_options_has_the_structs_defaults():
    assert worker_config(_parse("decode", "--model", "/m", "--etcd", "http://e")) == WorkerConfig(
        role="decode", model="/m", etcd="http://e"
    )


def test_every_worker_option_sets_its_field():
    args = _parse(
        "prefill",
        "--model",
        "/m",
        "--etcd",
        "http://e",
        "--model-name",
        "llama",
        "--host",
        "0.0.0.0",
        "--port",
        "7001",
        "--advertise-host",
        "node-1",
        "--worker-id",
        "p-1",
        "--lease-ttl",
        "3s",
        "--drain-timeout",
        "500ms",
        "--hold",
        "10s",
        "--num-threads",
        "2",
        "--metrics-port",
        "-1",
        "--dtype",
        "bfloat16",
        "--kernels",
        "torch",
        "--kv-cache-memory",
        "1G",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "512",
        "--max-model-len",
        "256",
        "--no-prefix-caching",
    )
    assert worker_config(args) == WorkerConfig(
        role="prefill",
        model="/m",
        etcd="http://e",
        model_name="llama",
        host="0.0.0.0",
        port=7001,
        advertise_host="node-1",
        worker_id="p-1",
        lease_ttl_s=3.0,
        drain_timeout_s=0.5,
        hold_s=10.0,
        num_threads=2,
        metrics_port=None,
        engine=EngineConfig(
            dtype="bfloat16",
            kernels="torch",
            kv_cache_memory=2**30,
            max_num_seqs=8,
            max_num_batched_tokens=512,
            max_model_len=256,
            enable_prefix_caching=False,
        ),
    )


def test_tensor_parallel_size_sets_the_workers_parallel_config():
    args = _parse("decode", "--model", "/m", "--etcd", "http://e", "--tensor-parallel-size", "2")
    assert worker_config(args) == WorkerConfig(
        role="decode", model="/m", etcd="http://e", parallel=ParallelConfig(tensor_parallel_size=2)
    )
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        worker_config(_parse("decode", "--model", "/m", "--etcd", "http://e", "--tensor-parallel-size", "0"))


def test_every_frontend_option_sets_its_field_and_the_thresholds_former_name_still_works():
    assert frontend_config(_parse("frontend"), "http://e") == FrontendConfig(etcd="http://e")
    args = _parse(
        "frontend",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--disaggregation",
        "always",
        "--local-prefill-threshold",
        "16",
        "--prefill-saturation-tokens",
        "100",
        "--max-queued-requests",
        "7",
        "--request-timeout",
        "30s",
        "--tokenizer",
        "/t",
        "--metrics-port",
        "9100",
        "--stats-window",
        "2s",
    )
    assert frontend_config(args, "http://e") == FrontendConfig(
        etcd="http://e",
        host="0.0.0.0",
        port=0,
        max_queued_requests=7,
        request_timeout_s=30.0,
        tokenizer="/t",
        metrics_port=9100,
        stats_window_s=2.0,
        router=RouterConfig(disaggregation="always", local_prefill_threshold_tokens=16, prefill_saturation_tokens=100),
    )
    former = frontend_config(_parse("frontend", "--local-prefill-tokens", "24"), "http://e")
    assert former.router.local_prefill_threshold_tokens == 24


@pytest.mark.parametrize("command", ["up", "prefill", "decode", "frontend"])
def test_the_help_shows_the_structs_defaults(command: str):
    result = _pdserve(command, "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines
    if command != "frontend":
        assert f"most requests running at once (default: {EngineConfig().max_num_seqs})" in text
        assert f"(default: {EngineConfig().max_num_batched_tokens})" in text
    if command in ("up", "frontend"):
        defaults = FrontendConfig(etcd="")
        assert f"public gRPC port (default: {defaults.port})" in text
        assert f"(default: {defaults.router.disaggregation})" in text
        assert "--local-prefill-threshold TOKENS conditional:" in text and "--local-prefill-tokens" not in text
        assert f"(default: {defaults.router.local_prefill_threshold_tokens})" in text
    if command in ("prefill", "decode"):
        assert "--config FILE" in text
        assert f"registry lease TTL (default: {field_default(WorkerConfig, 'lease_ttl_s'):g}s)" in text


def _write(path: Path, config: msgspec.Struct) -> str:
    path.write_bytes(msgspec.json.encode(config))
    return str(path)


def test_a_config_file_comes_alone_and_for_its_own_role(tmp_path: Path):
    config = _write(tmp_path / "prefill.json", WorkerConfig(role="prefill", model=str(tmp_path), etcd="http://e"))
    wrong_role = _pdserve("decode", "--config", config)
    assert (
        wrong_role.returncode == 2 and "configures a prefill worker; run it with `pdserve prefill`" in wrong_role.stderr
    )
    beside = _pdserve("prefill", "--config", config, "--max-num-seqs", "8", "--etcd", "http://other")
    assert beside.returncode == 2
    assert f"--config {config} is the whole configuration: set max_num_seqs, etcd in it" in beside.stderr
    both = _pdserve("prefill", "--config", config, "--model", str(tmp_path))
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_a_bad_config_file_fails_naming_the_field_before_anything_starts(tmp_path: Path):
    bad = tmp_path / "worker.json"
    bad.write_text(
        json.dumps(
            {
                "role": "prefill",
                "model": str(tmp_path),
                "etcd": "http://e",
                "engine": {"max_num_batched_tokens": "lots"},
            }
        )
    )
    result = _pdserve("prefill", "--config", str(bad))
    assert result.returncode == 2
    assert "`$.engine.max_num_batched_tokens`" in result.stderr and "Traceback" not in result.stderr


def test_a_frontend_started_from_a_config_file_serves_with_it(tmp_path: Path, etcd_url: str):
    # The router's threshold is what the frontend publishes in etcd: proof the file's settings arrived.
    threshold = 40 + uuid.uuid4().int % 1000
    router = RouterConfig(local_prefill_threshold_tokens=threshold)
    config = _write(
        tmp_path / "frontend.json", FrontendConfig(etcd=etcd_url, port=0, http_port=0, metrics_port=None, router=router)
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "frontend", "--config", config],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if "listening on" in line:
                break
        assert lines and "listening on" in lines[-1], "".join(lines)
        port = bound_port(lines[-1])
        assert any(stats.local_prefill_tokens == threshold for stats in _published_frontends(etcd_url, port))
    finally:
        process.terminate()
        process.wait(30)


def _published_frontends(etcd_url: str, port: int, timeout_s: float = 10.0) -> list[FrontendStats]:
    async def read() -> list[FrontendStats]:
        client = await connect(etcd_url)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                mine = [s for s in await list_frontend_stats(client) if s.frontend_id.endswith(f"-{port}")]
                if mine or time.monotonic() > deadline:
                    return mine
                await asyncio.sleep(0.2)
        finally:
            await close_quietly(client)

    return asyncio.run(read())


def test_api_keys_come_from_options_a_file_and_the_environment_each_once(tmp_path: Path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nsk-file\n\nsk-a\n")
    monkeypatch.setenv("PDSERVE_API_KEYS", "sk-env, sk-a")
    args = _parse("frontend", "--api-key", "sk-a", "--api-key", "sk-b", "--api-key-file", str(keys))
    assert frontend_config(args, "http://e").api_keys == ["sk-a", "sk-b", "sk-file", "sk-env"]
    monkeypatch.delenv("PDSERVE_API_KEYS")
    with pytest.raises(ValueError, match="--api-key-file .*nothing"):
        frontend_config(_parse("frontend", "--api-key-file", str(tmp_path / "nothing")), "http://e")
