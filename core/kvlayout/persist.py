"""Save and restore a cache: one safetensors file, written atomically, checked on load.

The file is plain safetensors (any safetensors reader opens it): the tensors
a layout chose to keep (its pools, gathered to what is live, and any
bookkeeping arrays), and in the header's string metadata one key,
`"kvlayout"`, whose value is a JSON object:

- `format`: FORMAT_VERSION, checked first;
- `layout`: the key (`"mlx:cell"`), `distribution` and `version`: who wrote it;
- `content`: `"cache"` (a whole cache, for `load`) or `"sequence"` (one
  sequence of the cell layout, for `CellCache.load_seq`);
- `config`: `CacheConfig.to_mapping()`;
- `state`: the layout's bookkeeping, its own JSON (with its own version);
- `sha256`: over the metadata without this key (canonical JSON) and every
  tensor in name order (name, dtype, shape, bytes).

The format itself is the `safetensors` library's: `safetensors.serialize`
writes the bytes, `safetensors.deserialize` and `safe_open(...).metadata()`
read them back. Its serialization is deterministic (tensors ordered by dtype
then name, the header padded to 8 bytes), so a file must also be byte for byte
what serializing its own tensors and metadata again gives: with the checksum
over the contents, a flipped byte anywhere (data, offsets, shapes, padding,
metadata) is refused. bfloat16 is stored as BF16 (its bit patterns, untouched).

`write_atomic` writes a temporary file in the target's directory, fsyncs it,
`os.replace`s it over the target and fsyncs the directory: a crash at any
point leaves the previous file whole.

`load(path)` reads the metadata, finds the layout through the registry by its
key and hands the file to the Builder's `load` callable (a layout opts in by
filling that field). Everything it refuses (a truncated, corrupted,
other-version, other-layout or mismatched file) raises StateError and loads
nothing. A `path` that cannot name a state file (not a str or os.PathLike,
empty, a directory, in a directory that does not exist) is a StateError
naming it, raised before anything is read or written (`state_path`); so is
an OSError while writing (the previous file stays whole). This module is
tensor-agnostic (bytes and numpy); the MLX conversions live in
`kvlayout.mlx.tensors`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import safetensors

from kvlayout import registry
from kvlayout.builder import split_layout_key
from kvlayout.config import CacheConfig
from kvlayout.errors import ConfigError, KVLayoutError, StateError, os_reason

FORMAT_VERSION = 1
META_KEY = "kvlayout"
CONTENTS = ("cache", "sequence")

# safetensors dtype codes kvlayout stores, with their numpy dtypes; BF16 has
# none (numpy has no bfloat16) and is kept as its 2-byte bit patterns.
_CODE_NUMPY = {
    code: np.dtype(dt)
    for code, dt in {
        "F16": "<f2", "F32": "<f4", "I32": "<i4", "I64": "<i8", "U64": "<u8", "U32": "<u4", "U16": "<u2"
    }.items()
}
_NUMPY_CODES = {dt.newbyteorder("="): code for code, dt in _CODE_NUMPY.items()}
DTYPE_SIZES = {"BF16": 2, **{code: dt.itemsize for code, dt in _CODE_NUMPY.items()}}


@attrs.frozen
class RawTensor:
    """One tensor as safetensors stores it: dtype code, shape, little-endian bytes."""

    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(x) for x in s))
    data: bytes | memoryview = attrs.field(repr=False)

    def __attrs_post_init__(self):
        if self.dtype not in DTYPE_SIZES:
            raise KVLayoutError(f"tensor dtype {self.dtype!r}: expected one of {', '.join(DTYPE_SIZES)}")
        need = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if len(self.data) != need:
            raise KVLayoutError(f"tensor {self.dtype}{list(self.shape)}: {len(self.data)} bytes, expected {need}")


def raw_numpy(a: np.ndarray) -> RawTensor:
    """A numpy array (float16/32, int32/64, uint16/32/64) as a RawTensor."""
    a = np.ascontiguousarray(a)
    code = _NUMPY_CODES.get(a.dtype.newbyteorder("="))
    if code is None:
        raise KVLayoutError(f"numpy dtype {a.dtype}: cannot be stored")
    return RawTensor(code, a.shape, a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())


def numpy_of(t: RawTensor) -> np.ndarray:
    """A RawTensor as a (read-only) numpy array; BF16 has no numpy dtype and is refused."""
    if t.dtype not in _CODE_NUMPY:
        raise KVLayoutError(f"tensor dtype {t.dtype}: no numpy dtype holds it")
    return np.frombuffer(t.data, dtype=_CODE_NUMPY[t.dtype]).reshape(t.shape)


@attrs.frozen
class StateFile:
    """What `read_state` found in a file, checked against its checksum."""

    path: Path
    layout: str
    distribution: str | None
    version: str | None
    content: str
    config: dict
    state: dict
    tensors: dict[str, RawTensor] = attrs.field(repr=False)

    def cache_config(self) -> CacheConfig:
        """The CacheConfig the file was saved with; StateError if it is not one."""
        try:
            return CacheConfig.from_mapping(self.config)
        except (ConfigError, TypeError) as exc:
            raise StateError(f"{self.path}: the saved config is not a valid CacheConfig ({exc})") from None

    def tensor(self, name: str, dtype: str | Iterable[str], shape: tuple[int | None, ...]) -> RawTensor:
        """Tensor `name`, checked against a dtype (or several) and a shape (None: any size)."""
        t = self.tensors.get(name)
        if t is None:
            raise StateError(f"{self.path}: tensor {name!r} is missing; the file holds {sorted(self.tensors)}")
        dtypes = (dtype,) if isinstance(dtype, str) else tuple(dtype)
        ok = t.dtype in dtypes and len(t.shape) == len(shape)
        ok = ok and all(want is None or got == want for got, want in zip(t.shape, shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise StateError(
                f"{self.path}: tensor {name!r} is {t.dtype}{list(t.shape)}, expected {'/'.join(dtypes)}{want}"
            )
        return t

    def refuse(self, what: str) -> StateError:
        return StateError(f"{self.path}: {what}")


# -- paths ---------------------------------------------------------------------


def state_path(path: Any, writing: bool) -> Path:
    """`path` as the Path of a state file to read or (`writing`) write; StateError naming it when it
    cannot be one: not a str or os.PathLike of str, empty, an existing directory, or (writing) in a
    directory that does not exist. Checked before a layout gathers anything to save."""
    ok = isinstance(path, (str, os.PathLike)) and not isinstance(path, bytes)
    try:
        p = Path(path) if ok else None
    except TypeError:  # an os.PathLike of bytes
        p = None
    if p is None or str(path) == "":
        raise StateError(
            f"path={path!r:.80}: expected a file path (a non-empty str or os.PathLike), got {type(path).__name__}"
        )
    if p.is_dir():
        raise StateError(f"path={str(p)!r}: is a directory; expected the path of a state file")
    if writing and not (p.parent if str(p.parent) else Path(".")).is_dir():
        raise StateError(f"path={str(p)!r}: its directory {str(p.parent)!r} does not exist")
    return p


# -- writing -------------------------------------------------------------------


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def checksum(meta: Mapping[str, Any], tensors: Mapping[str, RawTensor]) -> str:
    """sha256 over the metadata (less its own `sha256`) and every tensor in name order."""
    h = hashlib.sha256()
    h.update(_canonical({k: v for k, v in meta.items() if k != "sha256"}))
    for name in sorted(tensors):
        t = tensors[name]
        h.update(_canonical([name, t.dtype, list(t.shape), len(t.data)]))
        h.update(t.data)
    return h.hexdigest()


def _serialize(metadata: dict[str, str], tensors: Mapping[str, RawTensor]) -> bytes:
    """The safetensors bytes of `tensors` (stored as they are, BF16 included) and `metadata`."""
    keep = []  # the buffers the specs point into, alive until serialize returns
    specs = {}
    for name, t in tensors.items():
        buf = np.frombuffer(t.data, dtype=np.uint8)
        keep.append(buf)
        dtype = "bfloat16" if t.dtype == "BF16" else _CODE_NUMPY[t.dtype].name
        specs[name] = safetensors.TensorSpec(dtype=dtype, shape=t.shape, data_ptr=buf.ctypes.data, data_len=buf.nbytes)
    return bytes(safetensors.serialize(specs, metadata=metadata))


def encode(meta: Mapping[str, Any], tensors: Mapping[str, RawTensor]) -> list[bytes | memoryview]:
    """The file's chunks: the length-prefixed header, then every tensor's bytes."""
    meta = {**meta, "format": FORMAT_VERSION}
    meta["sha256"] = checksum(meta, tensors)
    blob = memoryview(_serialize({META_KEY: _canonical(meta).decode()}, tensors))
    head = len(blob) - sum(len(t.data) for t in tensors.values())
    return [bytes(blob[:head]), blob[head:]]


def _write_chunk(f, chunk: bytes | memoryview) -> None:
    """One chunk to the temporary file (a seam: the tests make it fail part way)."""
    f.write(chunk)


def write_atomic(path: str | os.PathLike, chunks: Iterable[bytes | memoryview]) -> Path:
    """Write `chunks` to `path` so that a crash at any point leaves the previous file whole.

    A temporary file in the same directory is written and fsynced, then
    `os.replace`d over `path`, then the directory is fsynced so the rename
    itself is durable. On any failure (KeyboardInterrupt included) the
    temporary file is removed and the exception propagates.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                _write_chunk(f, chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)
    return path


def _fsync_dir(directory: Path) -> None:
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform without directory fds: the rename is all we can do
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _provider(layout: str, pm: Any) -> tuple[str | None, str | None]:
    builder = registry.resolve(*split_layout_key(layout), pm)
    return builder.distribution, builder.version


def save_state(
    path: str | os.PathLike,
    *,
    layout: str,
    content: str,
    config: CacheConfig,
    state: Mapping[str, Any],
    tensors: Mapping[str, RawTensor],
    pm: Any = None,
) -> Path:
    """Write one state file atomically; the provider is looked up by `layout` in the registry.
    StateError for a `path` that is no file path (`state_path`) or that the OS refuses to write."""
    path = state_path(path, writing=True)
    if content not in CONTENTS:
        raise KVLayoutError(f"content={content!r}: expected one of {', '.join(CONTENTS)}")
    distribution, version = _provider(layout, pm)
    meta = {
        "layout": layout,
        "distribution": distribution,
        "version": version,
        "content": content,
        "config": config.to_mapping(),
        "state": dict(state),
    }
    try:
        return write_atomic(path, encode(meta, tensors))
    except OSError as exc:  # write_atomic removed its temporary file; the previous file is whole
        raise StateError(f"path={str(path)!r}: cannot write the state file ({os_reason(exc)})") from exc


# -- reading -------------------------------------------------------------------


def read_state(path: str | os.PathLike) -> StateFile:
    """Parse and check a state file; StateError for anything but a whole, intact file.

    Checked in order: the file exists; safetensors parses it (header, dtypes,
    shapes, offsets tiling the data exactly); it carries kvlayout metadata;
    the format version; the file is byte for byte what serializing its
    tensors and (canonical) metadata again gives (so no byte of the header
    can change unnoticed, padding and escapes included); the checksum. The
    layout and config are not looked at here (see `load`). The metadata is
    read by a second open of `path`; were the file replaced in between, the
    byte-for-byte check refuses the mix.
    """
    path = state_path(path, writing=False)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise StateError(f"{path}: no such state file") from None
    except OSError as exc:
        raise StateError(f"{path}: cannot read the state file ({exc})") from None
    entries, meta = _parse(path, data)
    tensors: dict[str, RawTensor] = {}
    for name, entry in entries:
        try:
            tensors[name] = RawTensor(entry["dtype"], entry["shape"], memoryview(entry["data"]).toreadonly())
        except KVLayoutError as exc:
            raise StateError(f"{path}: corrupted entry for tensor {name!r} ({exc})") from None
    _check_intact(path, data, meta, tensors)
    return _state_file(path, meta, tensors)


def _parse(path: Path, data: bytes) -> tuple[list, dict]:
    """(safetensors entries, kvlayout metadata) of the file `data` was read from; StateError for a file
    safetensors cannot parse, one without kvlayout metadata, or one of another format version."""
    try:
        entries = safetensors.deserialize(data)
        with safetensors.safe_open(path, framework="numpy") as sf:
            header_meta = sf.metadata() or {}
    except (safetensors.SafetensorError, OSError, ValueError) as exc:
        raise StateError(f"{path}: truncated or corrupted: not a whole safetensors file ({exc})") from None
    try:
        meta = json.loads(header_meta[META_KEY])
    except (KeyError, ValueError, TypeError) as exc:
        raise StateError(f"{path}: not a kvlayout state file, or its header is corrupted ({exc})") from None
    if not isinstance(meta, dict):
        raise StateError(f"{path}: corrupted header: expected a JSON object")
    fmt = meta.get("format")
    if fmt != FORMAT_VERSION:
        raise StateError(f"{path}: state format version {fmt!r}; this kvlayout reads version {FORMAT_VERSION}")
    return entries, meta


def _check_intact(path: Path, data: bytes, meta: dict, tensors: Mapping[str, RawTensor]) -> None:
    """StateError unless `data` is byte for byte the file kvlayout writes for `meta` and `tensors`,
    and its checksum holds."""
    # Serialized again from what was parsed (the metadata re-encoded canonically), it must be the file.
    try:
        again = _serialize({META_KEY: _canonical(meta).decode()}, tensors)
    except ValueError:  # a value canonical JSON refuses (NaN, infinity)
        again = None
    if again != data:
        raise StateError(f"{path}: corrupted: the file is not byte for byte in the form kvlayout writes")
    if meta.get("sha256") != checksum(meta, tensors):
        raise StateError(f"{path}: checksum mismatch: the file is corrupted (sha256 of its contents differs)")


def _state_file(path: Path, meta: dict, tensors: dict[str, RawTensor]) -> StateFile:
    """The StateFile of an intact file; StateError for metadata lacking a field or of an unknown content."""
    try:
        f = StateFile(
            path=path,
            layout=_field(meta, "layout", str),
            distribution=meta.get("distribution"),
            version=meta.get("version"),
            content=_field(meta, "content", str),
            config=_field(meta, "config", dict),
            state=_field(meta, "state", dict),
            tensors=tensors,
        )
    except KeyError as exc:
        raise StateError(f"{path}: metadata lacks {exc}") from None
    if f.content not in CONTENTS:
        raise StateError(f"{path}: content {f.content!r}: expected one of {', '.join(CONTENTS)}")
    return f


def _field(meta: dict, key: str, kind: type) -> Any:
    value = meta[key]
    if not isinstance(value, kind):
        raise KeyError(f"{key!r} of type {kind.__name__}")
    return value


def config_differences(a: CacheConfig, b: CacheConfig) -> list[str]:
    """The CacheConfig fields where `a` and `b` differ, as 'field: a vs b'."""
    ma, mb = a.to_mapping(), b.to_mapping()
    return [f"{k}: {ma.get(k)!r} vs {mb.get(k)!r}" for k in sorted(set(ma) | set(mb)) if ma.get(k) != mb.get(k)]


def load(path: str | os.PathLike, config: CacheConfig | None = None, pm: Any = None, layout: str | None = None) -> Any:
    """The cache saved at `path` (by `cache.save`), rebuilt by the layout that wrote it.

    The layout is found by the file's key through the registry, and must come
    from the distribution that wrote the file (its version may differ: the
    layout checks its own state version). With `config`, the file's config
    (a CacheConfig or a mapping of one) must equal it; with `layout` (a key),
    the file must be that layout's. Refused (StateError, nothing built) when
    `path` names no file, or the file is truncated, corrupted, of another
    format version, holds one sequence rather than a cache, names a layout
    not installed (or one that cannot load, or not `layout`), or does not
    match `config`.
    """
    if config is not None:
        config = CacheConfig.coerce(config)  # ConfigError naming config for anything but a config
    f = read_state(path)
    if layout is not None and f.layout != layout:
        raise f.refuse(f"saved by layout {f.layout}, not {layout}")
    if f.content != "cache":
        raise f.refuse(f"holds one sequence of {f.layout}, not a cache; load it with load_seq on such a cache")
    try:
        builder = registry.resolve(*split_layout_key(f.layout, "the file's layout"), pm)
    except KVLayoutError as exc:
        raise f.refuse(f"saved by layout {f.layout}, which cannot be resolved: {exc}") from exc
    if f.distribution != builder.distribution:
        raise f.refuse(
            f"saved by {f.layout} from {f.distribution} {f.version}, but {builder.key} is provided by "
            f"{builder.provider()}"
        )
    if builder.load is None:
        raise f.refuse(f"layout {builder.key} ({builder.provider()}) cannot restore a saved cache")
    saved = f.cache_config()
    if config is not None and saved != config:
        raise f.refuse(f"saved with another config ({'; '.join(config_differences(saved, config))})")
    return builder.load(f)
