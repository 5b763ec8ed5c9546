"""QuantizedPool: a layer's K or V stored affine-quantized, as three MLXPools.

A write quantizes exactly the tokens it stores (`mx.quantize` over each
head's row of D elements, `group_size` to a scale and bias), so a cell once
written is never quantized again: forks, prefixes and saved files share its
bits. Updates are cast to float16 first (SCALES), whatever the model's dtype,
so the stored triple depends on the values alone; mlx-lm's QuantizedKVCache
on a float16 model stores the very same bits.

The three parts grow, are written and are read together, slot for slot:
`packed` (uint32 `[1, H, slots, D * bits / 32]`), `scales` and `biases`
(float16 `[1, H, slots, D / group_size]`). A read is a QuantizedKV of views.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kvlayout.config import QUANTIZED_KV_BITS
from kvlayout.errors import KVLayoutError
from kvlayout.mlx.pool import PACKED, SCALES, MLXPool
from kvlayout.pool import Pool
from kvlayout.spec import QuantizedKV


class QuantizedPool(Pool):
    """K or V of one layer as packed words, scales and biases (see the module); the Pool verbs.

    `write`/`write_cells` take a float `[1, H, n, D]` update (quantized here)
    or a QuantizedKV of that logical shape at this pool's bits and group size
    (stored as it is: how a saved file comes back bit for bit).
    """

    def __init__(self, initial_slots: int, max_slots: int, n_heads: int, head_dim: int, bits: int, group_size: int):
        if bits not in QUANTIZED_KV_BITS.values():
            raise KVLayoutError(f"bits={bits!r}: expected one of {', '.join(map(str, QUANTIZED_KV_BITS.values()))}")
        if head_dim % group_size or group_size * bits % 32:
            raise KVLayoutError(f"head_dim={head_dim}: expected a multiple of group_size={group_size}")
        self.bits, self.group_size = bits, group_size
        self._dim = head_dim
        self.packed = MLXPool(initial_slots, max_slots, n_heads, head_dim * bits // 32, PACKED)
        self.scales = MLXPool(initial_slots, max_slots, n_heads, head_dim // group_size, SCALES)
        self.biases = MLXPool(initial_slots, max_slots, n_heads, head_dim // group_size, SCALES)
        self._parts = (self.packed, self.scales, self.biases)

    @property
    def slots(self) -> int:
        return self.packed.slots

    @property
    def max_slots(self) -> int:
        return self.packed.max_slots

    @property
    def dtype(self) -> mx.Dtype:
        """The float dtype every write is cast to before it is quantized (and scales are kept in)."""
        return SCALES

    @property
    def n_heads(self) -> int:
        return self.packed.n_heads

    @property
    def head_dim(self) -> int:
        return self._dim

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._parts)

    def write(self, start: int, update: Any) -> None:
        for pool, part in zip(self._parts, self._quantized(update).parts()):
            pool.write(start, part)

    def write_cells(self, cells: Sequence[int], update: Any) -> None:
        q = self._quantized(update)
        self.packed.write_cells(cells, q.packed)  # checks the cells before any part is written (the
        self.scales.write_cells(cells, q.scales)  # parts' shapes agree: `_quantized` checked them)
        self.biases.write_cells(cells, q.biases)

    def read(self, start: int, length: int) -> QuantizedKV:
        """Slots `[start, start + length)`: a QuantizedKV of `[1, H, length, .]` views."""
        return self._record(*(p.read(start, length) for p in self._parts))

    def take(self, cells: Any) -> QuantizedKV:
        """The slots `cells` (each < slots): a QuantizedKV of `[1, H, n, .]` copies."""
        idx = cells if isinstance(cells, mx.array) else mx.array([int(c) for c in cells], dtype=mx.int32)
        return self._record(*(p.take(idx) for p in self._parts))

    def evaluate(self) -> None:
        """Finish every pending write on all three parts (see `MLXPool.evaluate`)."""
        mx.eval(*(p.read(0, p.slots) for p in self._parts))

    def _record(self, packed: mx.array, scales: mx.array, biases: mx.array) -> QuantizedKV:
        return QuantizedKV(packed, scales, biases, self.bits, self.group_size)

    def _quantized(self, update: Any) -> QuantizedKV:
        """`update` as a triple at this pool's bits and group size; KVLayoutError naming what is wrong."""
        if isinstance(update, QuantizedKV):
            if (update.bits, update.group_size) != (self.bits, self.group_size):
                raise KVLayoutError(
                    f"update quantized at {update.bits} bits, group {update.group_size}: expected "
                    f"{self.bits} bits, group {self.group_size}"
                )
            if update.scales.dtype != SCALES or update.biases.dtype != SCALES:
                raise KVLayoutError(f"update scales of dtype {update.scales.dtype}: expected float16")
            # Every part checked against this pool before any is written: a refusal changes nothing.
            n = update.packed.shape[2] if isinstance(update.packed, mx.array) and update.packed.ndim == 4 else None
            for name, part, pool in zip(("packed", "scales", "biases"), update.parts(), self._parts):
                shape = tuple(part.shape) if isinstance(part, mx.array) else type(part).__name__
                if n is None or shape != (1, pool.n_heads, n, pool.head_dim) or part.dtype != pool.dtype:
                    raise KVLayoutError(
                        f"update {name} of shape {shape}: expected [1, {pool.n_heads}, n, {pool.head_dim}] "
                        f"{pool.dtype}, n the packed words' token count"
                    )
            return update
        if not isinstance(update, mx.array) or not mx.issubdtype(update.dtype, mx.floating):
            got = f"{update.dtype}" if isinstance(update, mx.array) else type(update).__name__
            raise KVLayoutError(f"update: expected a floating mlx array or a QuantizedKV, got {got}")
        shape = tuple(update.shape)
        if len(shape) != 4 or shape[0] != 1 or shape[1] != self.n_heads or shape[3] != self._dim:
            raise KVLayoutError(f"update shape {shape}: expected [1, {self.n_heads}, n, {self._dim}]")
        if shape[2] == 0:  # mx.quantize refuses an empty array; an empty triple writes nothing
            words, groups = self.packed.head_dim, self.scales.head_dim
            return self._record(
                mx.zeros((1, self.n_heads, 0, words), PACKED), *(mx.zeros((1, self.n_heads, 0, groups), SCALES),) * 2
            )
        packed, scales, biases = mx.quantize(update.astype(SCALES), group_size=self.group_size, bits=self.bits)
        return self._record(packed, scales, biases)


def kv_pool(initial_slots: int, max_slots: int, n_heads: int, head_dim: int, config: Any) -> Pool:
    """The pool a layout keeps one layer's K (or V) in under `config` (a CacheConfig): an MLXPool
    of its float kv_dtype, or a QuantizedPool at its bits and kv_group_size."""
    if config.kv_bits is None:
        return MLXPool(initial_slots, max_slots, n_heads, head_dim, config.kv_dtype)
    return QuantizedPool(initial_slots, max_slots, n_heads, head_dim, config.kv_bits, config.kv_group_size)

