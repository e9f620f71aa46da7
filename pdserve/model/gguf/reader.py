"""A GGUF file's header, metadata and tensor directory, read with every offset checked.

GGUF (llama.cpp's format): ``GGUF`` magic, version, tensor and key-value counts, the
key-values, one record per tensor (name, dims, ggml type, offset), then the tensor data from
the next multiple of ``general.alignment``. This reader parses the header itself rather than
with ``gguf.GGUFReader``, which builds a numpy view per array element and takes 6 to 11 s
on the 49152-token vocabulary of SmolLM2 here; a walk with ``struct`` takes well under a
second. A short or inconsistent file raises ``GGUFError`` naming the file and the byte offset
where it went wrong. The parsed header is kept per file (path, size and modification time), so
the engine's three readers (configuration, weights, tokenizer) parse it once. Tensor data are
memory-mapped and dequantized on request (``dequant``: every type the ``gguf`` package knows).
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pdserve.model.gguf.dequant import can_dequantize, dequantize

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types: id -> (struct format, size); 8 is a string and 9 an array.
_SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file is malformed, truncated or holds something pdserve cannot use; the message
    names the file (and, for a malformed file, the byte offset)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_id: int
    shape: tuple[int, ...]  # row-major (outermost first), as torch and Hugging Face name it
    start: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"unknown ggml type {self.type_id}"


class _Parser:
    """One pass over a GGUF header in ``buf``; every read checks the bounds first."""

    def __init__(self, path: Path, buf: mmap.mmap) -> None:
        self.path, self.buf, self.size, self.pos = path, buf, len(buf), 0

    def fail(self, what: str, offset: int | None = None) -> GGUFError:
        return GGUFError(f"{self.path}: {what} at offset {self.pos if offset is None else offset}")

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise self.fail(f"truncated: {what} needs {n} bytes, the file ends at {self.size}")

    def scalar(self, type_id: int, what: str) -> Any:
        fmt, size = _SCALARS[type_id]
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        start = self.pos
        length = self.scalar(10, f"length of {what}")
        self.need(length, what)
        self.pos += length
        try:
            return self.buf[start + 8 : self.pos].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8", start) from None

    def strings(self, count: int, what: str) -> list[str]:
        # The vocabulary and merges are ~100k strings: one tight loop, bounds checked per item.
        buf, pos, size, unpack = self.buf, self.pos, self.size, struct.Struct("<Q").unpack_from
        items = []
        try:
            for index in range(count):
                if pos + 8 > size:
                    raise self.fail(f"truncated: length of {what}[{index}] needs 8 bytes, the file ends at {size}", pos)
                (length,) = unpack(buf, pos)
                end = pos + 8 + length
                if end > size:
                    raise self.fail(
                        f"truncated: {what}[{index}] needs {length} bytes, the file ends at {size}", pos + 8
                    )
                items.append(buf[pos + 8 : end].decode("utf-8"))
                pos = end
        except UnicodeDecodeError:
            raise self.fail(f"{what}[{len(items)}] is not UTF-8", pos + 8) from None
        self.pos = pos
        return items

    def value(self, type_id: int, what: str) -> Any:
        if type_id in _SCALARS:
            return self.scalar(type_id, what)
        if type_id == _STRING:
            return self.string(what)
        if type_id == _ARRAY:
            start = self.pos
            item_type = self.scalar(4, f"item type of {what}")
            count = self.scalar(10, f"length of {what}")
            if item_type in _NUMPY:
                size = np.dtype(_NUMPY[item_type]).itemsize
                if count * size > self.size:
                    raise self.fail(f"truncated: {what} claims {count} items, the file ends at {self.size}", start)
                self.need(count * size, what)
                values = np.frombuffer(self.buf, dtype=_NUMPY[item_type], count=count, offset=self.pos).tolist()
                self.pos += count * size
                return values
            if item_type == _STRING:
                return self.strings(count, what)
            if item_type == _ARRAY:
                return [self.value(_ARRAY, f"{what}[{i}]") for i in range(count)]
            raise self.fail(f"{what}: unknown array item type {item_type}", start)
        raise self.fail(f"{what}: unknown value type {type_id}", self.pos - 4)

    def parse(self) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
        if self.size < 4 or self.buf[:4] != MAGIC:
            raise self.fail("not a GGUF file (no GGUF magic)", 0)
        self.pos = 4
        version = self.scalar(4, "version")
        if version not in (2, 3):
            hint = " (a big-endian file? pdserve reads little-endian GGUF)" if version in (2 << 24, 3 << 24) else ""
            raise self.fail(f"unsupported GGUF version {version}{hint}", 4)
        num_tensors = self.scalar(10, "tensor count")
        num_kv = self.scalar(10, "metadata count")
        metadata: dict[str, Any] = {}
        for index in range(num_kv):
            key = self.string(f"metadata key #{index}")
            metadata[key] = self.value(self.scalar(4, f"type of {key}"), key)
        infos = []
        for index in range(num_tensors):
            at = self.pos
            name = self.string(f"name of tensor #{index}")
            num_dims = self.scalar(4, f"dimension count of {name}")
            if num_dims > 8:
                raise self.fail(f"tensor {name} claims {num_dims} dimensions", at)
            dims = [self.scalar(10, f"dimension of {name}") for _ in range(num_dims)]
            type_id = self.scalar(4, f"type of {name}")
            offset = self.scalar(10, f"data offset of {name}")
            infos.append((at, name, dims, type_id, offset))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise GGUFError(f"{self.path}: general.alignment is {alignment!r}, not a positive integer")
        data_start = -(-self.pos // alignment) * alignment
        tensors = {}
        for at, name, dims, type_id, offset in infos:
            nbytes = self.tensor_nbytes(name, dims, type_id, at)
            start = data_start + offset
            if start + nbytes > self.size:
                raise self.fail(
                    f"truncated: tensor {name} needs {nbytes} bytes from offset {start}, the file ends at {self.size}",
                    start,
                )
            # GGUF lists dims innermost first; torch and Hugging Face outermost first.
            tensors[name] = GGUFTensor(name, type_id, tuple(reversed(dims)), start, nbytes)
        return metadata, tensors

    def tensor_nbytes(self, name: str, dims: list[int], type_id: int, at: int) -> int:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise self.fail(f"tensor {name} has unknown ggml type {type_id}", at) from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if dims and dims[0] % block_size:
            raise self.fail(
                f"tensor {name}: row of {dims[0]} values is not a whole number of {qtype.name} blocks of {block_size}",
                at,
            )
        return math.prod(dims) // block_size * type_size


@functools.lru_cache(maxsize=4)
def _header(path: Path, size: int, mtime_ns: int) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _Parser(path, buf).parse()


class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key -> value, not to be modified) and ``tensors``
    (name -> GGUFTensor); ``read`` dequantizes a tensor."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        stat = os.stat(self.path)
        if stat.st_size == 0:
            raise GGUFError(f"{self.path}: empty file, not GGUF")
        self.metadata, self.tensors = _header(self.path.resolve(), stat.st_size, stat.st_mtime_ns)
        with self.path.open("rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as float32 (row-major ``shape``), dequantized; a fresh tensor."""
        tensor = self.tensors[name]
        try:
            qtype = GGMLQuantizationType(tensor.type_id)
        except ValueError:
            raise GGUFError(f"{self.path}: tensor {name} has {tensor.type_name}") from None
        if not can_dequantize(qtype):
            raise GGUFError(f"{self.path}: tensor {name} is {qtype.name}, a ggml type pdserve cannot dequantize")
        raw = np.frombuffer(self._map, dtype=np.uint8, count=tensor.nbytes, offset=tensor.start)
        return dequantize(raw, qtype, tensor.shape)

    def close(self) -> None:
        """Unmap the file; tensors returned by ``read`` stay valid (they are copies)."""
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still referenced (by a traceback, say): the mapping goes with it

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
