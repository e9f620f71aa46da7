"""How fast one engine replica is: the numbers the planner's models and the simulator run on.

An ``EngineProfile`` is measured on the engine itself (``profiler.profile_engine``) for one
model, device and dtype, and stored as JSON. Two curves:

- prefill: seconds for one step that computes a prompt of ``n`` tokens, sampled at a few
  lengths and interpolated piecewise-linearly (extrapolated along the last segment beyond
  the longest measured prompt). Attention makes it superlinear at long prompts, so a
  straight line through the points would be wrong at one end or the other.
- decode: seconds for one decode step, measured on a small grid of batch sizes by context
  tokens per sequence and interpolated bilinearly (extrapolated linearly beyond the grid).
  A linear model ``a + b * batch + c * context_tokens`` was tried and rejected: on the CPU
  reference backend a step of 64 sequences costs about 4 us a context token past ~16k
  tokens against 1 us below, and twice what 32 sequences of the same total context cost,
  so the best fit (relative error) missed the large steps by up to 57%.

``builtin_profile`` gives the profiles shipped with pdserve, by model file: the default model's,
measured on CPU with one thread (as ``charts/pdserve/examples/default-model.yaml`` runs it), so a
planner for it needs no profile of the user's making.
"""

from __future__ import annotations

import bisect
import posixpath
from pathlib import Path

import msgspec

from pdserve.model.default_model import WHEEL_MEMBER

# Model file name → the profile shipped for it (package data next to this module).
_BUILTIN = {posixpath.basename(WHEEL_MEMBER): "default_model.cpu.profile.json"}


class PrefillPoint(msgspec.Struct, frozen=True):
    tokens: int
    seconds: float


class DecodeGrid(msgspec.Struct, frozen=True, kw_only=True):
    """Decode step seconds: ``seconds[i][j]`` for ``batches[i]`` sequences of
    ``context_per_seq[j]`` context tokens each (both ascending)."""

    batches: list[int]
    context_per_seq: list[int]
    seconds: list[list[float]]

    def __post_init__(self) -> None:
        for name in ("batches", "context_per_seq"):
            axis = getattr(self, name)
            if not axis or axis != sorted(set(axis)) or axis[0] < 1:
                raise ValueError(f"decode {name} must be distinct positive ascending values, got {axis}")
        shape = (len(self.batches), len(self.context_per_seq))
        if len(self.seconds) != shape[0] or any(len(row) != shape[1] for row in self.seconds):
            raise ValueError(f"decode seconds must be a {shape[0]} x {shape[1]} grid")
        if any(value <= 0 for row in self.seconds for value in row):
            raise ValueError("decode seconds must be positive")


class EngineProfile(msgspec.Struct, frozen=True, kw_only=True):
    """Measured speed and capacity of one engine replica (one worker)."""

    name: str  # what was measured: model shape, device, dtype, kernels
    source: str  # how: the command or code that produced it
    prefill: list[PrefillPoint]  # ascending tokens
    decode: DecodeGrid
    kv_capacity_tokens: int  # KV cache size of one replica, in tokens
    kv_bytes_per_token: int  # what a prompt token costs to transfer
    max_num_seqs: int

    def __post_init__(self) -> None:
        if not self.prefill:
            raise ValueError("prefill needs at least one measured point")
        tokens = [p.tokens for p in self.prefill]
        if tokens != sorted(set(tokens)) or tokens[0] < 1:
            raise ValueError(f"prefill points must have distinct positive tokens in ascending order, got {tokens}")
        if any(p.seconds <= 0 for p in self.prefill):
            raise ValueError("prefill seconds must be positive")
        if self.kv_capacity_tokens < 1 or self.max_num_seqs < 1 or self.kv_bytes_per_token < 1:
            raise ValueError("kv_capacity_tokens, kv_bytes_per_token and max_num_seqs must be >= 1")

    def prefill_seconds(self, tokens: float) -> float:
        """Seconds to prefill ``tokens`` prompt tokens in one step; 0 for none."""
        if tokens <= 0:
            return 0.0
        points = self.prefill
        if len(points) == 1:
            return points[0].seconds * max(tokens / points[0].tokens, 1.0)
        if tokens <= points[0].tokens:
            # Below the shortest prompt measured the step's fixed cost dominates: no cheaper.
            return points[0].seconds
        index = min(bisect.bisect_left([p.tokens for p in points], tokens), len(points) - 1)
        left, right = points[index - 1], points[index]
        slope = (right.seconds - left.seconds) / (right.tokens - left.tokens)
        return max(left.seconds + slope * (tokens - left.tokens), points[0].seconds)

    def prefill_tokens_per_s(self, tokens: float) -> float:
        """One worker's prefill throughput on prompts of ``tokens`` tokens, one at a time."""
        return tokens / self.prefill_seconds(tokens)

    def decode_step_seconds(self, batch: float, context_tokens: float) -> float:
        """Seconds for one decode step of ``batch`` requests holding ``context_tokens`` in all."""
        if batch <= 0:
            return 0.0
        grid = self.decode
        i, fb = _segment(grid.batches, batch)
        j, fc = _segment(grid.context_per_seq, context_tokens / batch)
        # Below the shortest context measured, a step is no cheaper (attention is a small share).
        fc = max(fc, 0.0)
        t = grid.seconds
        i1, j1 = min(i + 1, len(t) - 1), min(j + 1, len(t[0]) - 1)
        value = (1 - fb) * ((1 - fc) * t[i][j] + fc * t[i][j1]) + fb * ((1 - fc) * t[i1][j] + fc * t[i1][j1])
        return max(value, min(t[0]))

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(self), indent=2) + b"\n")

    @staticmethod
    def load(path: str | Path) -> EngineProfile:
        """Read a saved profile; raises ValueError naming the file when it does not decode."""
        try:
            return msgspec.json.decode(Path(path).read_bytes(), type=EngineProfile)
        except msgspec.DecodeError as error:
            raise ValueError(f"{path}: not an engine profile ({error})") from None


def builtin_profile(model_path: str) -> Path | None:
    """The profile shipped for the model file at ``model_path`` (a path in a pod), or None."""
    name = _BUILTIN.get(posixpath.basename(model_path.rstrip("/")))
    return None if name is None else Path(__file__).with_name(name)


def _segment(axis: list[int], x: float) -> tuple[int, float]:
    """The grid cell ``[axis[i], axis[i + 1]]`` for ``x`` and where ``x`` lies in it
    (below 0 or above 1 outside the axis: linear extrapolation from the edge cell)."""
    if len(axis) == 1:
        return 0, 0.0
    i = min(max(bisect.bisect_right(axis, x) - 1, 0), len(axis) - 2)
    return i, (x - axis[i]) / (axis[i + 1] - axis[i])
