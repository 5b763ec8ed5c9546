"""The header of a GGUF file: its metadata and its table of tensors, read without the data.

`mx.load` reads a GGUF too, but it silently dequantizes the types MLX has no
layout for (K-quants, IQ types) to float16, and it reads every tensor before
we could see the architecture. Reading the header first lets the converter
refuse a file, naming the key or the tensor and its type, before any work.

The format (GGUF v2 and v3, little-endian): magic "GGUF", version (u32),
tensor count (u64), metadata count (u64); then the metadata as (key, type,
value); then per tensor its name, dims (innermost first, so reversed here to
MLX's order), GGML type (u32) and data offset (u64).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kvlayout.errors import ConfigError

# The GGML tensor types by id (ggml.h), for naming them in errors.
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
    35: "TQ2_0", 39: "MXFP4",
}

# Metadata value types: id -> (struct code, numpy dtype) for the fixed-size ones.
_SCALARS = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


@attrs.frozen
class TensorInfo:
    ggml_type: str
    shape: tuple[int, ...]  # MLX / HF order: [rows, cols] for a matrix


@attrs.frozen
class GGUFHeader:
    version: int
    metadata: dict[str, Any]  # scalars as Python values, arrays of numbers as numpy, strings as str
    tensors: dict[str, TensorInfo]


class _Reader:
    """Sequential little-endian reads over the mapped file; running off its end is a ConfigError."""

    def __init__(self, buf, source: str):
        self.buf, self.pos, self.source = buf, 0, source

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ConfigError(f"{self.source}: truncated GGUF header (at byte {self.pos})")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ConfigError(f"{self.source}: truncated GGUF header (a string at byte {self.pos})")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int, key: str):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind][0])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = self.unpack("<I"), self.unpack("<Q")
            if elem == _STRING:
                return [self.string() for _ in range(count)]
            if elem not in _SCALARS:
                raise ConfigError(f"{self.source}: metadata {key!r} is an array of value type {elem}, unknown to GGUF")
            dtype = np.dtype(_SCALARS[elem][1])
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise ConfigError(f"{self.source}: truncated GGUF header (metadata {key!r})")
            arr = np.frombuffer(self.buf, dtype=dtype.newbyteorder("<"), count=count, offset=self.pos).copy()
            self.pos = end
            return arr
        raise ConfigError(f"{self.source}: metadata {key!r} has value type {kind}, unknown to GGUF")


def read_header(path: Path) -> GGUFHeader:
    """The metadata and tensor table of the GGUF at `path`; a ConfigError names what is wrong."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise ConfigError(f"{source}: no such GGUF file")
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise ConfigError(f"{source}: not a GGUF file (empty)") from None
    with buf:
        if buf[:4] != b"GGUF":
            raise ConfigError(f"{source}: not a GGUF file (it does not start with 'GGUF')")
        r = _Reader(buf, source)
        r.pos = 4
        version = r.unpack("<I")
        if version not in (2, 3):
            raise ConfigError(f"{source}: GGUF version {version} is not supported; expected 2 or 3")
        n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
        metadata = {}
        for _ in range(n_kv):
            key = r.string()
            metadata[key] = r.value(r.unpack("<I"), key)
        tensors = {}
        for _ in range(n_tensors):
            name = r.string()
            dims = [r.unpack("<Q") for _ in range(r.unpack("<I"))]
            kind = r.unpack("<I")
            r.unpack("<Q")  # the data offset: mx.load reads the data
            tensors[name] = TensorInfo(GGML_TYPES.get(kind, f"type {kind}"), tuple(reversed(dims)))
    return GGUFHeader(version, metadata, tensors)


REQUIRED = object()  # `default` for a key the model cannot do without
KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def meta_scalar(meta: dict[str, Any], key: str, source: str, kind: type, default: Any = REQUIRED) -> Any:
    """The one value at metadata `key` as a `kind` (int, float, bool or str); `default` when absent.

    The file is the user's: a missing required key, an array where one value
    belongs (per-layer values) or a value of another kind (a string id, an
    int flag) is a ConfigError naming the key, never a ValueError from `int()`
    or a string taken as true. An int is a number too; a bool is never one.
    """
    if key not in meta:
        if default is REQUIRED:
            raise ConfigError(f"{source}: metadata {key!r} is missing (a llama GGUF has it)")
        return default
    value = meta[key]
    if isinstance(value, (list, np.ndarray)):
        raise ConfigError(f"{source}: metadata {key!r} is an array (per-layer values are not supported)")
    if kind is bool or kind is str:
        fits = isinstance(value, kind)
    else:
        fits = isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
    if not fits:
        raise ConfigError(f"{source}: metadata {key!r} is {value!r}; expected {KINDS[kind]}")
    return kind(value)
