"""attend(): apply an AttendSpec with MLX's fused attention."""

from __future__ import annotations

import mlx.core as mx

from kvlayout.faces import AttendSpec, MaskKind


def attend(q: mx.array, spec: AttendSpec, scale: float) -> mx.array:
    """Attention of `q` `[1, H_q, T, D]` over the spec's keys `[1, H_kv, S, D]`.

    GQA is native to `scaled_dot_product_attention` (H_q a multiple of H_kv),
    so heads are never repeated. Storage may be narrower than the model's
    compute dtype; K/V are cast to q's dtype so the product is computed there.
    MLX's "causal" is lower-right aligned: query i sees keys up to S - T + i.
    """
    keys, values = spec.keys, spec.values
    if keys.dtype != q.dtype:
        keys, values = keys.astype(q.dtype), values.astype(q.dtype)
    if spec.mask_kind is MaskKind.NONE:
        mask = None
    elif spec.mask_kind is MaskKind.CAUSAL:
        mask = "causal"
    else:
        mask = spec.mask
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
