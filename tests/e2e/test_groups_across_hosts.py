"""Worker groups whose ranks run on separate hosts, served end to end.

Two hosts (bench/lib/hosts.py: network namespaces with their own address, loopback and
/dev/shm), so that the rendezvous, gloo and NIXL's pulls cross a network as between machines.
Host A runs etcd, the frontend, and rank 0 of each group; host B runs rank 1 of whichever
pool is split. Every process is ``pdserve`` as a user starts it; the client is
``pdserve generate --target`` on host A, and transformers the reference.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass
from subprocess import PIPE, STDOUT, Popen

import pytest
import torch

from bench.lib.hosts import Host, Hosts
from bench.lib.watched import Watched
from pdserve.launch.etcd_process import find_etcd
from tests.utils.checkpoints import VOCAB, reference_greedy

pytestmark = pytest.mark.slow
PDSERVE = [sys.executable, "-m", "pdserve"]
ETCD_PORT, FRONTEND_PORT = 2379, 50051


@dataclass
class Server:
    """A process on a host, its output watched and kept for a failure's report."""

    name: str
    output: Watched

    @property
    def process(self) -> Popen:
        return self.output.process

    @property
    def lines(self) -> list[str]:
        return self.output.lines

    @classmethod
    def start(cls, host: Host, name: str, argv: list[str]) -> Server:
        return cls(name, Watched(host.popen(argv, stdout=PIPE, stderr=STDOUT, text=True)))

    def wait_listening(self, timeout: float = 180) -> None:
        if not self.output.wait_listening(timeout):
            raise AssertionError(f"{self.name} did not come up:\n{self.output.tail(40)}")


class Cluster:
    """etcd, frontend, one prefill and one decode group over two hosts; the ``split`` pool's
    group of ``size`` ranks has its first half on host A and the rest on host B."""

    def __init__(
        self, hosts: Hosts, model: str, prefill: list[str], decode: list[str], split: str, size: int = 2
    ) -> None:
        self.hosts = hosts
        a, b = hosts[0], hosts[1]
        self.etcd_url = f"http://{a.address}:{ETCD_PORT}"
        self.servers: list[Server] = []
        etcd = [str(find_etcd()), "--data-dir", f"/dev/shm/etcd-{a.namespace}"]
        etcd += ["--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url]
        etcd += ["--listen-peer-urls", f"http://{a.address}:2380"]
        self.servers.append(Server.start(a, "etcd", etcd))
        common = ["--model", model, "--etcd", self.etcd_url, "--num-threads", "1", "--rendezvous-timeout", "120"]
        for role, options in (("prefill", prefill), ("decode", decode)):
            if role != split:
                self.servers.append(Server.start(a, role, [*PDSERVE, role, *common, "--host", a.address, *options]))
                continue
            for index in range(size):
                host = a if index < size // 2 else b
                place = ["--leader-address", a.address, "--group-size", str(size), "--group-index", str(index)]
                argv = [*PDSERVE, role, *common, "--host", host.address, *options, *place]
                self.servers.append(Server.start(host, f"{role}-rank{index}", argv))
        frontend = ["--etcd", self.etcd_url, "--host", a.address, "--port", str(FRONTEND_PORT), "--http-port", "0"]
        self.servers.append(Server.start(a, "frontend", [*PDSERVE, "frontend", *frontend]))
        for server in self.servers:
            if server.name in ("prefill", "decode", "prefill-rank0", "decode-rank0", "frontend"):
                server.wait_listening()

    def generate(self, prompt: list[int], max_tokens: int, deadline_s: float = 60) -> dict:
        """The completion, retried while the pools are still registering."""
        argv = [*PDSERVE, "generate", "--target", f"{self.hosts[0].address}:{FRONTEND_PORT}", "--json"]
        argv += ["--token-ids", ",".join(map(str, prompt)), "--max-tokens", str(max_tokens)]
        argv += ["--temperature", "0", "--ignore-eos", "--timeout", "60"]
        deadline = time.monotonic() + deadline_s
        while True:
            done = self.hosts[0].run(argv, timeout=90)
            if done.returncode == 0:
                return json.loads(done.stdout)
            if time.monotonic() > deadline:
                raise AssertionError(f"generate failed: {done.stderr}\n{self.report()}")
            time.sleep(1)

    def report(self) -> str:
        return "\n".join(f"--- {s.name} (exit {s.process.poll()}):\n{''.join(s.lines[-20:])}" for s in self.servers)


TP2 = ["--tensor-parallel-size", "2"]
DP2_EP = ["--data-parallel-size", "2", "--enable-expert-parallel"]
CASES = {
    # name: (architecture, prefill options, decode options, the pool whose ranks are split, its ranks)
    "llama-decode-tp2-over-2-hosts": ("llama", [], TP2, "decode", 2),
    "llama-prefill-tp2-over-2-hosts": ("llama", TP2, [], "prefill", 2),
    "deepseek-v3-decode-dp2-ep-over-2-hosts": ("deepseek_v3", DP2_EP, DP2_EP, "decode", 2),
    "deepseek-v3-prefill-dp2-ep-over-2-hosts": ("deepseek_v3", DP2_EP, DP2_EP, "prefill", 2),
    # A data-parallel rank's two tensor-parallel ranks on each host; TP 1 prefill ranks feed them.
    "deepseek-v3-decode-dp2xtp2-ep-over-2-hosts": ("deepseek_v3", DP2_EP, [*DP2_EP, *TP2], "decode", 4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers_with_a_group_over_two_hosts(case, checkpoints, two_hosts):
    arch, prefill, decode, split, size = CASES[case]
    path, hf_model = checkpoints(arch)
    cluster = Cluster(two_hosts, str(path), prefill, decode, split, size)
    generator = torch.Generator().manual_seed(17)
    compared = 0
    for n in (9, 21, 33, 14):
        prompt = torch.randint(3, VOCAB, (n,), generator=generator).tolist()
        result = cluster.generate(prompt, 8)
        reference, num_clear = reference_greedy(hf_model, prompt, 8)
        assert result["token_ids"][:num_clear] == reference[:num_clear], (prompt, cluster.report())
        compared += num_clear
    assert compared >= 12


def test_a_lost_host_fails_its_group_whose_streams_migrate_and_the_group_comes_back(checkpoints, two_hosts):
    """Rank 1's host loses its process mid-stream: rank 0 leaves the registry and exits 1 within
    seconds, the streams it carried finish on the other decode worker with the same greedy
    tokens, and the group, started again on both hosts, serves."""
    path, hf_model = checkpoints("llama")
    cluster = Cluster(two_hosts, str(path), [], TP2, "decode")
    a = two_hosts[0]
    spare = ["--model", str(path), "--etcd", cluster.etcd_url, "--num-threads", "1", "--host", a.address]
    cluster.servers.append(Server.start(a, "spare-decode", [*PDSERVE, "decode", *spare]))
    cluster.servers[-1].wait_listening()
    generator = torch.Generator().manual_seed(23)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (9, 13, 17, 21, 25, 29)]
    results: dict[int, dict] = {}

    def stream(i: int) -> None:
        results[i] = cluster.generate(prompts[i], 400, deadline_s=120)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    time.sleep(1.5)  # the streams are decoding
    rank0, rank1 = (next(s for s in cluster.servers if s.name == f"decode-rank{i}") for i in (0, 1))
    killed = time.monotonic()
    rank1.process.kill()
    assert rank0.process.wait(30) == 1, cluster.report()
    lost_after = time.monotonic() - killed
    for thread in threads:
        thread.join(180)
    assert len(results) == len(prompts), cluster.report()
    migrated = [r for r in results.values() if r["breakdown"].get("migrations", 0) > 0]
    assert migrated, "no stream was on the group when its rank died"
    assert all(r["breakdown"]["decode_worker"].startswith("decode-") for r in migrated)
    for i, result in results.items():
        assert len(result["token_ids"]) == 400
        reference, num_clear = reference_greedy(hf_model, prompts[i], 24)
        assert result["token_ids"][:num_clear] == reference[:num_clear], (i, result["breakdown"])
    assert lost_after < 30
    # The group again, on both hosts: it rejoins and serves.
    common = ["--model", str(path), "--etcd", cluster.etcd_url, "--num-threads", "1", *TP2]
    for index, host in enumerate(two_hosts):
        place = ["--leader-address", a.address, "--group-size", "2", "--group-index", str(index)]
        again = Server.start(
            host, f"decode-again{index}", [*PDSERVE, "decode", *common, "--host", host.address, *place]
        )
        cluster.servers.append(again)
    cluster.servers[-2].wait_listening()  # rank 0 listens once the group formed and registered
    assert cluster.servers[-1].process.poll() is None, cluster.report()
    next(s for s in cluster.servers if s.name == "spare-decode").process.terminate()
    result = cluster.generate(prompts[0], 8)
    assert result["breakdown"]["decode_worker"].startswith("decode-") and len(result["token_ids"]) == 8
