"""MLXPool: a layer's K or V storage as one MLX array `[1, H, slots, D]`.

In-place writes matter here. MLX updates an array in place only when nothing
else holds its buffer; `self._buf` is the single reference we keep, so a write
is O(bytes written). A caller that keeps a `read()` result alive across the
next write forces that write to copy the whole pool (bench/pool_write.py
measures both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from kvlayout.checks import FEW_ON_STEP, int_array, int_scalar
from kvlayout.config import QUANTIZED_KV_BITS, check_up_front
from kvlayout.errors import ConfigError, KVLayoutError
from kvlayout.mlx.checks import FLOATING
from kvlayout.pool import Pool

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
SCALES = mx.float16  # a quantized pool's scales and biases (kvlayout.mlx.quantized)
# MLX array dimensions are int32: no pool holds more slots (or heads, or head_dim) than this (a
# shape past it is an OverflowError in mx.zeros, and cell indices are int32 in every step record).
MAX_SLOTS = 2**31 - 1


# The packed words of a quantized pool (kvlayout.mlx.quantized) are an MLXPool of uint32 too.
PACKED = mx.uint32


class Cells:
    """Distinct cell indices, checked once and converted to MLX once, for every pool a step
    writes (a layer's K and V, every layer): `write_cells` then checks only that they fit.
    KVLayoutError from the constructor for indices that are not distinct integers >= 0 (`distinct`
    True: the caller vouches they are distinct, a placement's cells; they are not sorted again)."""

    def __init__(self, cells: Any, distinct: bool = False):
        # int32 already (a CellStep's cells): checked as they are, not widened to int64 and narrowed back.
        plain32 = type(cells) is np.ndarray and cells.dtype == np.int32 and cells.ndim == 1
        idx = cells if plain32 else int_array("cells", cells, KVLayoutError)
        # A decode step's few cells are checked in Python: numpy's reductions run cold on a step's path.
        if idx.size <= FEW_ON_STEP:
            listed = idx.tolist()
            low, high = (min(listed), max(listed)) if listed else (0, -1)
        else:
            low, high = int(idx.min()), int(idx.max())
        if low < 0:
            raise KVLayoutError(f"cells: expected cells >= 0, got {low}")
        # `distinct`: the caller knows (a placement's cells, which the plugin manager's referee checked
        # distinct): sorting them again is a step's host time for nothing.
        if not distinct and idx.size and np.unique(idx).size != idx.size:
            raise KVLayoutError("cells: expected distinct cells, got a repeated cell")
        self.host = idx.astype(np.int32)  # a copy of our own, whatever the caller does with theirs
        self.host.flags.writeable = False
        self.size = idx.size
        self.end = high + 1  # one past the highest
        self.slot_index = mx.array(self.host).reshape(1, 1, -1, 1)  # [1, 1, n, 1]: put_along_axis's slot indices


def _slot(value: Any, name: str) -> int:
    """`value` as a slot index or count >= 0 (KVLayoutError naming `name` otherwise); a plain int, the
    usual one, is taken at once."""
    if type(value) is int and value >= 0:
        return value
    return int_scalar(name, value, KVLayoutError, minimum=0)


def storage_dtype(dtype: Any) -> mx.Dtype:
    """The MLX dtype for a float name from CacheConfig.kv_dtype, an MLX float dtype, or uint32."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if dtype in DTYPES.values() or dtype == PACKED:
        return dtype
    raise KVLayoutError(f"pool dtype {dtype!r}: expected one of {', '.join(DTYPES)}")


def pool_bytes(slots: int, n_heads: int, head_dim: int, dtype: Any, group_size: int = 64) -> int:
    """Bytes the pool of one layer's K (or V) holding `slots` slots of `n_heads` x `head_dim`
    occupies in `dtype`: a float kv_dtype, or "q8"/"q4" (packed words, scales and biases, of
    `group_size` elements to a group)."""
    return slots * n_heads * slot_bytes(head_dim, dtype, group_size)


def config_pool_bytes(slots: int, n_heads: int, head_dim: int, config: Any) -> int:
    """Bytes one layer's K (or V) pool of `slots` slots holds under `config` (a CacheConfig)."""
    return pool_bytes(slots, n_heads, head_dim, config.kv_dtype, config.kv_group_size)


def cell_bytes(config: Any, kv_dtype: str | None = None, windowed: bool | None = None) -> int:
    """Bytes one token's K and V take across every layer of `config` (a CacheConfig), in its
    kv_dtype or in `kv_dtype` (what the same cells would take as float16, say); `windowed` True:
    across its sliding-window layers only, False: its flat layers only."""
    dtype = config.kv_dtype if kv_dtype is None else kv_dtype
    layers = (config.layer(i) for i in range(config.n_layers))
    if windowed is not None:
        layers = (lc for lc in layers if (lc.policy.window > 0) == windowed)
    return sum(2 * pool_bytes(1, lc.n_kv_heads, lc.head_dim, dtype, config.kv_group_size) for lc in layers)


def slot_bytes(head_dim: int, dtype: Any, group_size: int = 64) -> int:
    """Bytes one head's row of `head_dim` elements takes in a pool of `dtype` (see `pool_bytes`)."""
    bits = QUANTIZED_KV_BITS.get(dtype) if isinstance(dtype, str) else None
    if bits is None:
        return head_dim * storage_dtype(dtype).size
    return head_dim * bits // 8 + 2 * (head_dim // group_size) * SCALES.size


def check_layer_dims(config: Any) -> None:
    """ConfigError naming the field for a layer of `config` (a CacheConfig) whose n_kv_heads or
    head_dim no MLX array dimension holds (more than MAX_SLOTS)."""
    for i in range(config.n_layers):
        lc = config.layer(i)
        for name in ("n_kv_heads", "head_dim"):
            if getattr(lc, name) > MAX_SLOTS:
                raise ConfigError(
                    f"layer {i}: LayerConfig.{name}={getattr(lc, name)}: expected at most {MAX_SLOTS} "
                    "(MLX array dimensions are int32)"
                )


class MLXPool(Pool):
    """A layer's K or V: `initial_slots` allocated at once (clamped to `max_slots`), grown by
    doubling up to `max_slots` (at most MAX_SLOTS) as writes need. ConfigError, before any
    allocation, when the initial slots alone exceed the machine's memory."""

    def __init__(self, initial_slots: int, max_slots: int, n_heads: int, head_dim: int, dtype: Any = "float16"):
        self._max = int_scalar("max_slots", max_slots, KVLayoutError, minimum=1)
        if self._max > MAX_SLOTS:
            raise ConfigError(
                f"max_slots={self._max}: expected at most {MAX_SLOTS} (MLX array dimensions are int32)"
            )
        initial = min(int_scalar("initial_slots", initial_slots, KVLayoutError, minimum=0), self._max)
        self._heads = int_scalar("n_heads", n_heads, KVLayoutError, minimum=1)
        self._dim = int_scalar("head_dim", head_dim, KVLayoutError, minimum=1)
        for name, value in (("n_heads", self._heads), ("head_dim", self._dim)):
            if value > MAX_SLOTS:
                raise ConfigError(f"{name}={value}: expected at most {MAX_SLOTS} (MLX array dimensions are int32)")
        self._dtype = storage_dtype(dtype)
        check_up_front(
            f"an MLXPool of initial_slots={initial} x n_heads={self._heads} x head_dim={self._dim}",
            {"the pool": pool_bytes(initial, self._heads, self._dim, self._dtype)},
            "lower initial_slots",
        )
        self._buf = mx.zeros((1, self._heads, initial, self._dim), dtype=self._dtype)  # [1, H, slots, D]
        self._slots = initial  # the buffer's slot axis, kept as an int: every write and read compares with it

    @property
    def slots(self) -> int:
        return self._slots

    @property
    def max_slots(self) -> int:
        return self._max

    @property
    def dtype(self) -> mx.Dtype:
        return self._dtype

    @property
    def n_heads(self) -> int:
        return self._heads

    @property
    def head_dim(self) -> int:
        return self._dim

    @property
    def nbytes(self) -> int:
        return self._buf.nbytes

    def write(self, start: int, update: mx.array) -> None:
        n = self._check_update(update)
        start = _slot(start, "start")
        end = start + n
        if end > self._max:
            raise KVLayoutError(f"write of {n} slot(s) at start={start} ends at {end}, past max_slots={self._max}")
        if n == 0:  # nothing to store: allocate nothing (as write_cells)
            return
        self.write_run(start, update)

    def write_run(self, start: int, update: mx.array) -> None:
        end = start + update.shape[2]  # checked by `write`, or by the layout (Pool.write_run)
        if end > self._slots:
            self._grow_to(end)
        # Assigning into self._buf keeps it the buffer's single reference, so MLX
        # updates in place (O(bytes written)) unless a caller still holds a read().
        self._buf[:, :, start:end, :] = update.astype(self._dtype)

    def write_placed(self, cells: Cells, update: mx.array) -> None:
        self._scatter(cells.end, cells.slot_index, update)  # checked by the layout (Pool.write_placed)

    def read_run(self, start: int, length: int) -> mx.array:
        return self._buf[:, :, start : start + length, :]  # [1, H, length, D]; within slots (Pool.read_run)

    def write_cells(self, cells: Sequence[int], update: mx.array) -> None:
        """Scatter token i of `update` into slot `cells[i]`.

        Relies on the cells being distinct (placement guarantees it; checked
        here because a repeated index would make the scatter order-dependent).
        `cells` may be a `Cells`, checked once for every pool the step writes.
        """
        n = self._check_update(update)
        if isinstance(cells, Cells):  # checked already: only whether they fit here
            if cells.size != n:
                raise KVLayoutError(f"cells: {cells.size} cell(s) for an update of {n} token(s)")
            if cells.end > self._max:
                raise KVLayoutError(f"cells: expected every cell in [0, {self._max}), got {cells.end - 1}")
            end, idx = cells.end, cells.slot_index
        else:
            host = self._check_cells(cells, n)
            end, idx = (int(host.max()) + 1 if n else 0), (mx.array(host).reshape(1, 1, -1, 1) if n else None)
        if n == 0:
            return
        self._scatter(end, idx, update)

    def _scatter(self, end: int, idx: mx.array, update: mx.array) -> None:
        """Token i of `update` into slot `idx[..., i, ...]` (`[1, 1, n, 1]`), the pool grown to `end` first."""
        if end > self._slots:
            self._grow_to(end)
        # put_along_axis, not `buf[:, :, idx, :] = update`: the same scatter, in place alike (the old buffer's
        # only reference is the one handed over), for a sixth of the host time (~6 us against ~40 per call).
        update = update if update.dtype == self._dtype else update.astype(self._dtype)
        self._buf = mx.put_along_axis(self._buf, idx, update, axis=2)

    def take(self, cells: Any) -> mx.array:
        """The slots `cells` (int32 mlx array or list of ints, each < slots), `[1, H, n, D]`: a copy."""
        idx = cells if isinstance(cells, mx.array) else mx.array(np.asarray(cells, dtype=np.int32))
        return self._buf[:, :, idx, :]

    def evaluate(self) -> None:
        """Finish every write pending on the pool (`mx.eval` of its buffer), creating no array.

        For a caller that times writes or must settle them before a
        measurement: evaluating a `read()` instead adds a slice to the work
        and, while that read lives, makes the next write copy the pool.
        """
        mx.eval(self._buf)

    def read(self, start: int, length: int) -> mx.array:
        start, length = _slot(start, "start"), _slot(length, "length")
        if start + length > self._slots:
            raise KVLayoutError(
                f"read of {length} slot(s) at start={start} ends at {start + length}, "
                f"past the {self.slots} allocated slot(s)"
            )
        return self._buf[:, :, start : start + length, :]  # [1, H, length, D]

    def _check_update(self, update: Any) -> int:
        # The usual update, settled in a few comparisons (every layer writes every step); anything
        # else goes through the checks below, which say what is wrong.
        if type(update) is mx.array:
            shape = update.shape  # one tuple: each `.shape` makes another
            if (len(shape) == 4 and shape[0] == 1 and shape[1] == self._heads and shape[3] == self._dim
                    and (update.dtype == PACKED if self._dtype == PACKED else update.dtype in FLOATING)):
                return shape[2]
        if not isinstance(update, mx.array):
            raise KVLayoutError(f"update: expected an mlx array, got {type(update).__name__}")
        if self._dtype == PACKED:  # packed words are bits: never cast
            if update.dtype != PACKED:
                raise KVLayoutError(f"update dtype {update.dtype}: expected uint32 (packed words)")
        elif not mx.issubdtype(update.dtype, mx.floating):
            raise KVLayoutError(f"update dtype {update.dtype}: expected a floating dtype")
        shape = tuple(update.shape)
        if len(shape) != 4 or shape[0] != 1 or shape[1] != self._heads or shape[3] != self._dim:
            raise KVLayoutError(
                f"update shape {shape}: expected [1, {self._heads}, n, {self._dim}]"
            )
        return shape[2]

    def _check_cells(self, cells: Any, n: int) -> np.ndarray:
        idx = int_array("cells", cells, KVLayoutError)
        if idx.size != n:
            raise KVLayoutError(f"cells: {idx.size} cell(s) for an update of {n} token(s)")
        if n and (idx.min() < 0 or idx.max() >= self._max):
            raise KVLayoutError(f"cells: expected every cell in [0, {self._max}), got {idx.min()}..{idx.max()}")
        if n and np.unique(idx).size != n:
            raise KVLayoutError("cells: expected distinct cells, got a repeated cell")
        return idx.astype(np.int32)

    def _grow_to(self, need: int) -> None:
        """Double from max(slots, 1) until `need` fits, never past max_slots; zero-padded."""
        if need <= self.slots:
            return
        new = max(self.slots, 1)
        while new < need:
            new *= 2
        new = min(new, self._max)
        pad = mx.zeros((1, self._heads, new - self.slots, self._dim), dtype=self._dtype)
        self._buf = mx.concatenate([self._buf, pad], axis=2)
        self._slots = new
