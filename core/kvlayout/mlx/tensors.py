"""MLX arrays to and from `kvlayout.persist.RawTensor` (the bytes a state file stores).

bfloat16 has no numpy dtype, so it crosses as its uint16 bit pattern
(`view`), which keeps every bit: a round trip is exact for every storage dtype.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from kvlayout.errors import KVLayoutError
from kvlayout.mlx.pool import DTYPES
from kvlayout.persist import RawTensor, StateFile, numpy_of, raw_numpy

CODES = {mx.float16: "F16", mx.bfloat16: "BF16", mx.float32: "F32"}
DTYPE_CODES = {name: CODES[dtype] for name, dtype in DTYPES.items()}  # CacheConfig.kv_dtype -> code


def to_raw(a: mx.array) -> RawTensor:
    """An MLX float array as a RawTensor (evaluates it)."""
    if a.dtype not in CODES:
        raise KVLayoutError(f"array dtype {a.dtype}: expected float16, bfloat16 or float32")
    if a.dtype == mx.bfloat16:
        bits = np.array(a.view(mx.uint16))  # [..] the exact bit patterns
        return RawTensor("BF16", a.shape, np.ascontiguousarray(bits).astype("<u2", copy=False).tobytes())
    return raw_numpy(np.array(a))


def from_raw(t: RawTensor) -> mx.array:
    """A RawTensor of F16, BF16 or F32 as an MLX array of that dtype."""
    if t.dtype == "BF16":
        bits = np.frombuffer(t.data, dtype="<u2").reshape(t.shape)
        return mx.array(bits.astype(np.uint16)).view(mx.bfloat16)
    if t.dtype not in ("F16", "F32"):
        raise KVLayoutError(f"tensor dtype {t.dtype}: expected F16, BF16 or F32")
    return mx.array(numpy_of(t))


def read_kv(f: StateFile, config: Any, kept: Sequence[int]) -> list[tuple[mx.array, mx.array]]:
    """Each layer's saved K and V (tensors `k.{i}`, `v.{i}`), layer i holding `kept[i]` tokens:
    `[1, H_kv, kept[i], D]` in the config's kv_dtype; StateError (from the file) otherwise."""
    code = DTYPE_CODES[config.kv_dtype]
    out = []
    for i, n in enumerate(kept):
        lc = config.layer(i)
        shape = (1, lc.n_kv_heads, n, lc.head_dim)
        out.append(tuple(from_raw(f.tensor(f"{name}.{i}", code, shape)) for name in ("k", "v")))
    return out
