"""Safetensors checkpoints, memory-mapped.

Each ``*.safetensors`` file is mapped once; a tensor is a view into that mapping, so a
weight already in the wanted dtype on CPU costs no copy at all, and one needing a cast or a
move to the GPU is copied exactly once. Models pull the tensors they need by name with
``Checkpoint.get``, which checks the shape and says which file and tensor is wrong.

Block-FP8 checkpoints (DeepSeek-V3's format, ``pdserve.kernels.block_fp8``) store a linear
weight ``X.weight`` as F8_E4M3 beside its float32 ``X.weight_scale_inv``. Every such pair is
checked when the checkpoint is opened, before any weight is used. ``get`` returns a weight
dequantized into the model dtype; ``get_block_fp8`` keeps it FP8 for a backend whose GEMM
reads it so.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from pdserve.kernels.block_fp8 import FP8_DTYPE, BlockFP8Weight, expected_scale_shape

_ST_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": FP8_DTYPE,
}
SCALE_SUFFIX = "_scale_inv"  # X.weight's block scales are X.weight_scale_inv


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing or malformed; the message names which."""


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the file
    end: int


class Checkpoint:
    """All tensors of a model directory: one ``model.safetensors`` or sharded with an index."""

    def __init__(
        self,
        path: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        show_progress: bool = True,
        weight_block_size: tuple[int, int] | None = None,
    ) -> None:
        """``weight_block_size`` (config.json's ``quantization_config``) is required when any
        tensor is FP8: the shape of the blocks its scales cover."""
        self.path = Path(path)
        self.device = device
        self.dtype = dtype
        self.weight_block_size = weight_block_size
        self._entries: dict[str, _Entry] = {}
        self._maps: dict[Path, torch.Tensor] = {}
        self._mmaps: list[mmap.mmap] = []
        self._expected_file: dict[str, str] = {}  # from the index: which shard should hold a name
        self._progress = None
        files = self._find_files()
        for file in files:
            self._read_header(file)
        self._check_fp8_scales()
        total = sum(e.end - e.start for e in self._entries.values())
        if show_progress and total > 256 * 2**20:
            self._progress = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {self.path.name}")

    def _find_files(self) -> list[Path]:
        index_file = self.path / "model.safetensors.index.json"
        if index_file.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as error:
                raise CheckpointError(f"{index_file}: malformed index ({error})") from None
            self._expected_file = weight_map
            files = []
            for name in sorted(set(weight_map.values())):
                file = self.path / name
                if not file.is_file():
                    raise CheckpointError(
                        f"{index_file} names shard {name} (holding e.g. "
                        f"{next(k for k, v in weight_map.items() if v == name)}), which is missing"
                    )
                files.append(file)
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in model directory {self.path}")
        return files

    def _read_header(self, file: Path) -> None:
        size = file.stat().st_size
        with file.open("rb") as handle:
            raw = handle.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{file}: too short to be a safetensors file")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > size - 8:
                raise CheckpointError(f"{file}: header length {header_len} exceeds the file size")
            try:
                header = json.loads(handle.read(header_len))
            except json.JSONDecodeError as error:
                raise CheckpointError(f"{file}: unreadable safetensors header ({error})") from None
        base = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _ST_DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise CheckpointError(f"{file}: tensor {name} has unsupported dtype {info.get('dtype')}")
            start, end = info["data_offsets"]
            if base + end > size:
                raise CheckpointError(f"{file}: tensor {name} runs past the end of the file (truncated?)")
            self._entries[name] = _Entry(file, dtype, tuple(info["shape"]), base + start, base + end)

    def _check_fp8_scales(self) -> None:
        """Every FP8 tensor is a 2-D weight with a float scale tensor of its blocks' shape."""
        for name, entry in self._entries.items():
            if entry.dtype != FP8_DTYPE:
                continue
            if self.weight_block_size is None:
                raise CheckpointError(
                    f"{entry.file}: tensor {name} is F8_E4M3 but config.json has no quantization_config "
                    "with a weight_block_size"
                )
            if len(entry.shape) != 2:
                raise CheckpointError(f"{entry.file}: FP8 tensor {name} has shape {list(entry.shape)}; expected 2-D")
            scale_name = name + SCALE_SUFFIX
            want = list(expected_scale_shape(entry.shape, self.weight_block_size))
            scale = self._entries.get(scale_name)
            if scale is None:
                raise CheckpointError(
                    f"{self.path}: FP8 tensor {name} (shape {list(entry.shape)}) has no scale tensor {scale_name} "
                    f"(expected shape {want} for weight_block_size {list(self.weight_block_size)})"
                )
            if list(scale.shape) != want:
                raise CheckpointError(
                    f"{scale.file}: scale tensor {scale_name} has shape {list(scale.shape)}, expected {want} for "
                    f"{name} of shape {list(entry.shape)} in blocks of {list(self.weight_block_size)}"
                )
            if not scale.dtype.is_floating_point or scale.dtype == FP8_DTYPE:
                raise CheckpointError(
                    f"{scale.file}: scale tensor {scale_name} has dtype {scale.dtype}; expected float32"
                )

    def _mapping(self, file: Path) -> torch.Tensor:
        if file not in self._maps:
            with file.open("rb") as handle:
                # Copy-on-write: pages stay shared with the page cache and are never written.
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            self._mmaps.append(mapped)
            self._maps[file] = torch.frombuffer(mapped, dtype=torch.uint8)
        return self._maps[file]

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def is_block_fp8(self, name: str) -> bool:
        """Whether tensor ``name`` is stored block-FP8 (``get_block_fp8`` reads it as it is)."""
        entry = self._entries.get(name)
        return entry is not None and entry.dtype == FP8_DTYPE

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``name`` in the model dtype (or ``dtype``) on the model device, shape checked;
        an FP8 weight is dequantized (each value times its block's scale)."""
        if self.is_block_fp8(name):
            return self.get_block_fp8(name, shape).dequantize(dtype or self.dtype)
        return self._stored(name, shape).to(device=self.device, dtype=dtype or self.dtype)

    def get_block_fp8(self, name: str, shape: tuple[int, ...]) -> BlockFP8Weight:
        """FP8 weight ``name`` and its block scales on the model device, as stored."""
        assert self.weight_block_size is not None and self.is_block_fp8(name), f"{name} is not block-FP8"
        weight = self._stored(name, shape).to(self.device)
        scale_shape = expected_scale_shape(shape, self.weight_block_size)
        scale = self._stored(name + SCALE_SUFFIX, scale_shape).to(device=self.device, dtype=torch.float32)
        return BlockFP8Weight(weight, scale, self.weight_block_size)

    def _stored(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Tensor ``name`` as stored (a view of the mapped file, on the CPU), shape checked."""
        entry = self._entries.get(name)
        if entry is None:
            where = self._expected_file.get(name)
            hint = f" (the index puts it in {where})" if where else ""
            raise CheckpointError(f"{self.path}: missing tensor {name}{hint}")
        if entry.shape != tuple(shape):
            raise CheckpointError(f"{entry.file}: tensor {name} has shape {list(entry.shape)}, expected {list(shape)}")
        raw = self._mapping(entry.file)[entry.start : entry.end]
        if entry.start % raw.new_empty((), dtype=entry.dtype).element_size():
            raw = raw.clone()  # a misaligned tensor cannot be viewed in place
        tensor = raw.view(entry.dtype).view(entry.shape)
        if self._progress is not None:
            self._progress.update(entry.end - entry.start)
        return tensor

    def close(self) -> None:
        """Loading is over: the pages read so far leave this process's resident memory.

        Weights the model copied (merged, converted, repacked by the backend, moved to a
        GPU) would otherwise count twice. Tensors that are still views of the files fault
        their pages back in from the page cache when next read: the mapping is never
        written, so dropping its pages loses nothing.
        """
        if self._progress is not None:
            self._progress.close()
        for mapped in self._mmaps:
            mapped.madvise(mmap.MADV_DONTNEED)
