"""What every MLX layout checks of a step's K/V before it changes anything.

`update_and_fetch(layer, positions, k, v)` takes `k` and `v` as floating mlx
arrays `[1, H_kv, T, D]`, one token per position. Both shipped layouts check
them here, before placing or writing the step, so a refusal changes nothing
and reads the same whichever layout refused it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvlayout.errors import StepError

FLOATING = frozenset({mx.float16, mx.bfloat16, mx.float32, mx.float64})  # what mx.issubdtype(., mx.floating) admits


def check_kv(layer: int, k: Any, v: Any, n_kv_heads: int, head_dim: int, positions: int) -> int:
    """T, the tokens `k` and `v` carry; StepError naming the layer and the argument unless both
    are floating mlx arrays `[1, n_kv_heads, T, head_dim]` of one T, with one token per position
    (`positions` of them)."""
    # The usual step, settled in a few comparisons (a check per layer is host time every step pays);
    # anything else goes through the checks below, which say what is wrong.
    if type(k) is mx.array and type(v) is mx.array:
        shape = k.shape  # one tuple: each `.shape` makes another
        if (shape == (1, n_kv_heads, positions, head_dim) and shape == v.shape
                and k.dtype in FLOATING and v.dtype in FLOATING):
            return positions
    expected = (1, n_kv_heads, None, head_dim)  # [1, H_kv, T, D]
    for name, x in (("k", k), ("v", v)):
        shape = tuple(getattr(x, "shape", ()))
        if not isinstance(x, mx.array) or len(shape) != 4 or any(
            want is not None and got != want for got, want in zip(shape, expected)
        ):
            raise StepError(
                f"layer {layer}: {name} of shape {shape} ({type(x).__name__}): expected an mlx "
                f"array [1, {n_kv_heads}, T, {head_dim}]"
            )
        if not mx.issubdtype(x.dtype, mx.floating):  # a pool would refuse it only once the step is placed
            raise StepError(f"layer {layer}: {name} of dtype {x.dtype}: expected a floating mlx array")
    tokens = k.shape[2]
    if v.shape[2] != tokens:
        raise StepError(f"layer {layer}: k of {tokens} token(s) and v of {v.shape[2]} token(s): expected as many")
    if positions != tokens:
        raise StepError(f"layer {layer}: {positions} position(s) for k/v of {tokens} token(s)")
    return tokens
