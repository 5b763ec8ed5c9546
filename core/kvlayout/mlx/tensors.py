"""MLX arrays to and from `kvlayout.persist.RawTensor` (the bytes a state file stores).

bfloat16 has no numpy dtype, so it crosses as its uint16 bit pattern
(`view`), which keeps every bit: a round trip is exact for every storage dtype.

K or V of a quantized cache (QuantizedKV) is stored as its triple, never a
dequantized copy: tensor `NAME.packed` (U32), `NAME.scales` and
`NAME.biases` (F16) where a float cache has tensor `NAME`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from kvlayout.errors import KVLayoutError
from kvlayout.mlx.pool import DTYPES, PACKED, SCALES
from kvlayout.persist import RawTensor, StateFile, numpy_of, raw_numpy
from kvlayout.spec import QuantizedKV

CODES = {mx.float16: "F16", mx.bfloat16: "BF16", mx.float32: "F32", PACKED: "U32"}
DTYPE_CODES = {name: CODES[dtype] for name, dtype in DTYPES.items()}  # CacheConfig.kv_dtype -> code


QUANTIZED_PARTS = ("packed", "scales", "biases")


def kv_tensors(name: str, x: mx.array | QuantizedKV) -> dict[str, RawTensor]:
    """K or V as the tensors a state file keeps: `{name: ...}`, or a triple's three parts."""
    if isinstance(x, QuantizedKV):
        return {f"{name}.{part}": to_raw(a) for part, a in zip(QUANTIZED_PARTS, x.parts())}
    return {name: to_raw(x)}


def to_raw(a: mx.array) -> RawTensor:
    """An MLX float (or packed uint32) array as a RawTensor (evaluates it)."""
    if a.dtype not in CODES:
        raise KVLayoutError(f"array dtype {a.dtype}: expected float16, bfloat16, float32 or uint32")
    if a.dtype == mx.bfloat16:
        bits = np.array(a.view(mx.uint16))  # [..] the exact bit patterns
        return RawTensor("BF16", a.shape, np.ascontiguousarray(bits).astype("<u2", copy=False).tobytes())
    return raw_numpy(np.array(a))


def from_raw(t: RawTensor) -> mx.array:
    """A RawTensor of F16, BF16 or F32 as an MLX array of that dtype."""
    if t.dtype == "BF16":
        bits = np.frombuffer(t.data, dtype="<u2").reshape(t.shape)
        return mx.array(bits.astype(np.uint16)).view(mx.bfloat16)
    if t.dtype not in ("F16", "F32", "U32"):
        raise KVLayoutError(f"tensor dtype {t.dtype}: expected F16, BF16, F32 or U32")
    return mx.array(numpy_of(t))


def read_kv(f: StateFile, config: Any, kept: Sequence[int]) -> list[tuple[Any, Any]]:
    """Each layer's saved K and V (tensors `k.{i}`, `v.{i}`, or their triples' parts), layer i
    holding `kept[i]` tokens: `[1, H_kv, kept[i], D]` in the config's kv_dtype (a QuantizedKV of
    that logical shape for "q8"/"q4"); StateError (from the file) otherwise."""
    out = []
    for i, n in enumerate(kept):
        lc = config.layer(i)
        out.append(tuple(_read_one(f, config, f"{name}.{i}", (1, lc.n_kv_heads, n), lc.head_dim) for name in "kv"))
    return out


def _read_one(f: StateFile, config: Any, name: str, lead: tuple[int, int, int], head_dim: int) -> Any:
    bits = config.kv_bits
    if bits is None:
        return from_raw(f.tensor(name, DTYPE_CODES[config.kv_dtype], (*lead, head_dim)))
    widths = (head_dim * bits // 32, head_dim // config.kv_group_size, head_dim // config.kv_group_size)
    codes = (CODES[PACKED], CODES[SCALES], CODES[SCALES])
    parts = (
        from_raw(f.tensor(f"{name}.{part}", code, (*lead, w))) for part, code, w in zip(QUANTIZED_PARTS, codes, widths)
    )
    return QuantizedKV(*parts, bits, config.kv_group_size)
