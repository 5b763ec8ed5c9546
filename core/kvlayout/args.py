"""Integer argument checks shared by the pool and both layouts (numpy only, no MLX import).

A position or an id is an integer. Lists, numpy arrays and anything numpy can
read (an MLX array included) are accepted; floats, bools and NaN are refused
by name, because numpy would otherwise coerce `True` to 1 or `2.0` to 2
without a word.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlayout.errors import KVLayoutError


def int_array(name: str, values: Any, error: type[KVLayoutError]) -> np.ndarray:
    """`values` as a 1-d int64 array; `error` naming `name` if it is not integers."""
    if isinstance(values, (list, tuple)) and not {bool, np.bool_}.isdisjoint(map(type, values)):  # no subclasses
        raise error(f"{name}: expected integers, got a bool in {list(values)!r}")
    try:
        arr = np.asarray(values)
    except Exception as exc:  # e.g. an MLX dtype numpy cannot hold
        raise error(f"{name}: expected a 1-d sequence of integers, got {type(values).__name__} ({exc})") from exc
    if arr.ndim != 1:
        raise error(f"{name}: expected a 1-d sequence of integers, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    wide = []
    if arr.dtype == object or arr.dtype == np.uint64:  # only these can hold an int past int64
        wide = [x for x in arr.tolist() if isinstance(x, int) and not -(2**63) <= x < 2**63]
    if wide:  # a Python int numpy kept as object, or a uint64 that int64 would wrap negative
        raise error(f"{name}: {wide[0]} does not fit in 64 bits: expected int64 integers")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise error(f"{name}: expected integers, got dtype {arr.dtype} ({arr.tolist()!r:.80})")
    return arr.astype(np.int64, copy=False)


def int_scalar(name: str, value: Any, error: type[KVLayoutError], minimum: int | None = None) -> int:
    """`value` as an int (>= `minimum` if given); `error` naming `name` otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise error(f"{name}={value!r}: expected an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise error(f"{name}={value!r}: expected an integer >= {minimum}")
    return int(value)
