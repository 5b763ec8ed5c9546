"""attend(): apply an AttendSpec with MLX's fused attention."""

from __future__ import annotations

import mlx.core as mx

from kvlayout.faces import AttendGroups, AttendSpec, MaskKind


def attend(q: mx.array, spec: AttendSpec, scale: float) -> mx.array:
    """Attention of `q` `[1, H_q, T, D]` over the spec's keys `[1, H_kv, S, D]`.

    GQA is native to `scaled_dot_product_attention` (H_q a multiple of H_kv),
    so heads are never repeated. Storage may be narrower than the model's
    compute dtype; K/V are cast to q's dtype so the product is computed there.
    MLX's "causal" is lower-right aligned: query i sees keys up to S - T + i.
    A spec with `groups` takes the grouped path (`attend_groups`), which the
    layout chose because it does less work than the dense mask.
    """
    if spec.groups is not None:
        return attend_groups(q, spec.groups, scale)
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


def attend_groups(q: mx.array, groups: AttendGroups, scale: float) -> mx.array:
    """The dense EXPLICIT result, computed group by group in one batched SDPA.

    Each group's K/V rows are gathered from `groups.keys`/`values` (one
    `mx.take` per array, straight into `[G, H_kv, Kg, D]`), the group's
    queries are gathered likewise, one `scaled_dot_product_attention` runs
    with the groups on the batch axis, and the outputs go back to token order.
    Work: G * Qg * Kg query-key pairs plus G * Kg gathered rows, instead of
    T * S for the dense mask (the layout picks the cheaper; see its rule).
    """
    keys, values = groups.keys, groups.values  # [1, H_kv, S, D]
    _, h_kv, slots, d = keys.shape
    _, h_q, _, _ = q.shape
    n_groups, q_len = groups.tokens.shape
    # Row of (head h, cell c) in keys viewed as [H_kv * S, D]: free when keys is row-contiguous.
    rows = groups.cells[:, None, :] + (mx.arange(h_kv, dtype=mx.int32) * slots)[None, :, None]  # [G, H_kv, Kg]
    k = mx.take(keys.reshape(-1, d), rows, axis=0)  # [G, H_kv, Kg, D]
    v = mx.take(values.reshape(-1, d), rows, axis=0)
    if k.dtype != q.dtype:  # cast only what was gathered
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    qg = mx.take(q, groups.tokens.reshape(-1), axis=2)  # [1, H_q, G * Qg, D]
    qg = qg.reshape(h_q, n_groups, q_len, d).transpose(1, 0, 2, 3)  # [G, H_q, Qg, D]
    o = mx.fast.scaled_dot_product_attention(qg, k, v, scale=scale, mask=groups.mask)  # [G, H_q, Qg, D]
    o = o.transpose(1, 0, 2, 3).reshape(1, h_q, n_groups * q_len, d)  # [1, H_q, G * Qg, D]
    return mx.take(o, groups.out, axis=2)  # [1, H_q, T, D]
