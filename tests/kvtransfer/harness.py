"""Test side of the peer processes: start, command with timeouts, kill, stop."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import msgspec
import numpy as np
import torch

from tests.kvtransfer import protocol as p

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0  # torch import + NIXL/UCX start-up on a busy 2-core machine


class PeerProcess:
    """One peer (``tests.kvtransfer.peer_main``) in a subprocess; owns the process.

    ``prefix`` starts it through another program (``Host.enter_argv``: on another host);
    ``env`` adds to the environment; ``stderr`` is where its native output goes.
    """

    def __init__(
        self, cfg: p.PeerConfig, prefix: Sequence[str] = (), env: dict[str, str] | None = None, stderr: IO | None = None
    ) -> None:
        self.cfg = cfg
        env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tests.kvtransfer.peer_main", msgspec.json.encode(cfg).decode()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=ROOT,
            env=env,
        )
        self._replies: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._decoder = msgspec.json.Decoder(p.Reply)
        self.info: bytes | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._replies.put(line)
        self._replies.put(b"")

    def wait_ready(self) -> bytes:
        reply = self.receive(START_TIMEOUT_S)
        assert isinstance(reply, p.Ready), reply
        self.info = reply.info
        return reply.info

    def send(self, cmd: p.Command) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.json.encode(cmd) + b"\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> p.Reply:
        try:
            line = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.cfg.name}: no reply within {timeout}s") from None
        if not line:
            raise RuntimeError(f"{self.cfg.name} exited (rc={self.proc.poll()})")
        return self._decoder.decode(line)

    def request(self, cmd: p.Command, timeout: float = 30.0) -> p.Reply:
        self.send(cmd)
        return self.receive(timeout)

    def add_peer(self, other: PeerProcess) -> p.Done:
        assert other.info is not None
        reply = self.request(p.AddPeer(other.info))
        assert isinstance(reply, p.Done)
        return reply

    def status(self) -> p.PoolStatus:
        reply = self.request(p.Status())
        assert isinstance(reply, p.PoolStatus), reply
        return reply

    def dump(self, path: Path) -> torch.Tensor:
        """The peer's whole pool, read back through a file (raw bytes, not pickle)."""
        reply = self.request(p.Dump(str(path)))
        assert isinstance(reply, p.Done) and reply.ok, reply
        raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
        dtype = getattr(torch, self.cfg.dtype)
        return raw.view(dtype).view(self.cfg.spec().shape(self.cfg.num_blocks))

    def assert_pool_whole(self) -> None:
        """Block accounting is consistent and no block is referenced."""
        status = self.status()
        assert status.integrity_error is None, status.integrity_error
        assert status.num_free == status.num_blocks, status

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(p.Exit())
                self.proc.wait(timeout=15)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_all(cfgs: list[p.PeerConfig]) -> list[PeerProcess]:
    """Start peers in parallel (start-up dominates test time), wait for each to be ready."""
    peers = [PeerProcess(cfg) for cfg in cfgs]
    try:
        for peer in peers:
            peer.wait_ready()
    except BaseException:
        for peer in peers:
            peer.kill()
        raise
    return peers
