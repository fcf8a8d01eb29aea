"""The header of a GGUF file (its metadata and tensor table), read straight from a memory map.

gguf-py's `GGUFReader` makes a numpy view of every part of every field, the 100k+ strings of the
vocabulary and merges included, which takes seconds; the model needs only the scalar metadata
(its config) and where each tensor lies. Here arrays of strings are stepped over, never decoded
(the tokenizer is transformers' to read), and each tensor's bytes are a view of the map,
copied on write, so that torch can take them without a copy or a read-only warning.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# scalar value types: struct format (little-endian), size in bytes
_SCALARS: dict[int, tuple[str, int]] = {
    GGUFValueType.UINT8: ("<B", 1),
    GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4),
    GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4),
    GGUFValueType.BOOL: ("<?", 1),
    GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the table. `shape`: GGUF's order, innermost dimension first."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    data: np.ndarray  # uint8, its bytes in the file (a copy-on-write view)


@dataclass(frozen=True)
class GGUFHeader:
    """`fields`: every metadata key whose value is a scalar, a string or an array of numbers
    (a list); arrays of strings are left out."""

    fields: dict[str, Any]
    tensors: list[GGUFTensor]


def check_magic(path: str) -> None:
    """Raise ValueError naming `path` unless it starts with the GGUF magic."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (first bytes {magic!r}, expected b'GGUF')")


def read_header(path: str) -> GGUFHeader:
    """The header of the GGUF file `path`; ValueError naming it when it is not a readable
    (little-endian, version 2 or 3) GGUF file. The last file's header is kept while the file
    is unchanged (same size and mtime): the config and the weights both read it."""
    check_magic(path)
    stat = os.stat(path)
    return _cached_header(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _cached_header(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    """Parse `path`; `size` and `mtime_ns` only key the cache."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        return _Parser(buf).header()
    except (struct.error, IndexError, KeyError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} is not a valid GGUF file: {e}") from e


class _Parser:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def header(self) -> GGUFHeader:
        self.pos = len(GGUF_MAGIC)
        version = self._scalar(GGUFValueType.UINT32)
        if version & 0xFFFF == 0:
            raise ValueError("big-endian GGUF files are not supported")
        if version not in _SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors = self._scalar(GGUFValueType.UINT64)
        n_fields = self._scalar(GGUFValueType.UINT64)
        fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            value = self._value(self._scalar(GGUFValueType.UINT32))
            if value is not _STRINGS:
                fields[key] = value
        table = [self._tensor_info() for _ in range(n_tensors)]
        alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"bad general.alignment {alignment!r}")
        start = -(-self.pos // alignment) * alignment
        tensors = [
            GGUFTensor(name, shape, qtype, self._bytes(start + offset, _nbytes(shape, qtype)))
            for name, shape, qtype, offset in table
        ]
        if len({t.name for t in tensors}) != len(tensors):
            raise ValueError("a tensor name appears twice")
        return GGUFHeader(fields, tensors)

    def _scalar(self, vtype: int) -> Any:
        fmt, size = _SCALARS[vtype]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def _string(self) -> str:
        n = self._scalar(GGUFValueType.UINT64)
        start, self.pos = self.pos, self.pos + n
        if self.pos > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        return self.buf[start : self.pos].decode("utf-8")

    def _value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype != GGUFValueType.ARRAY:
            return self._scalar(vtype)
        item = self._scalar(GGUFValueType.UINT32)
        count = self._scalar(GGUFValueType.UINT64)
        if item == GGUFValueType.STRING:
            for _ in range(count):  # stepped over: only their lengths are read
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
            return _STRINGS
        if item == GGUFValueType.ARRAY:
            raise ValueError("nested arrays are not supported")
        fmt, size = _SCALARS[item]
        values = np.frombuffer(self.buf, np.dtype(fmt), count, self.pos).tolist()
        self.pos += size * count
        return values

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        n_dims = self._scalar(GGUFValueType.UINT32)
        shape = tuple(self._scalar(GGUFValueType.UINT64) for _ in range(n_dims))
        qtype = GGMLQuantizationType(self._scalar(GGUFValueType.UINT32))
        return name, shape, qtype, self._scalar(GGUFValueType.UINT64)

    def _bytes(self, offset: int, nbytes: int) -> np.ndarray:
        if offset + nbytes > len(self.buf):
            raise ValueError("a tensor runs past the end of the file")
        return np.frombuffer(self.buf, np.uint8, nbytes, offset)


_STRINGS = object()  # what `_value` returns for an array of strings (not kept)


def _nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape, dtype=np.int64))
    if shape and shape[0] % block_size:
        raise ValueError(f"a {qtype.name} row of {shape[0]} is not whole blocks of {block_size}")
    return n // block_size * type_size
