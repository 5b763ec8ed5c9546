"""attend(): apply an AttendSpec with MLX's fused attention."""

from __future__ import annotations

import math
import threading
from typing import Any

import mlx.core as mx

from kvlayout.checks import finite
from kvlayout.errors import ShapeError, StepError
from kvlayout.mlx.checks import FLOATING
from kvlayout.spec import AttendBatch, AttendGroups, AttendSpec, MaskKind, QuantizedKV


def attend(q: mx.array, spec: AttendSpec, scale: float, *, sinks: mx.array | None = None) -> mx.array:
    """Attention of `q` `[1, H_q, T, D]` over the spec's keys `[1, H_kv, S, D]`.

    GQA is native to `scaled_dot_product_attention` (H_q a multiple of H_kv),
    so heads are never repeated. Storage may be narrower than the model's
    compute dtype; K/V are cast to q's dtype so the product is computed there.
    MLX's "causal" is lower-right aligned: query i sees keys up to S - T + i.
    A spec with `groups` takes the grouped path (`attend_groups`), which the
    layout chose because it does less work than the dense mask. Quantized
    keys and values (QuantizedKV) go through `quantized_attention`, on every
    path.

    `sinks` (optional) `[H_q]`: attention sinks (gpt-oss), one learned logit
    per query head that joins every query's softmax denominator but carries
    no value: each path takes the softmax over `[scores..., sink]` and drops
    the sink's column, so a head can put weight on "nothing" instead of
    being forced to spread it over the keys. It is cast to q's dtype (MLX's
    fused attention requires sinks that promote to its output type). None
    (the default) adds no op: the result is the sink-free one, bit for bit.

    StepError naming the argument for a `spec` that is not an AttendSpec, a
    `q` that is not a floating `[B, H_q, T, D]` mlx array matching the keys
    (batch, head_dim, H_q a multiple of H_kv) or holding another T than
    `spec.queries`, a `scale` that is not a finite number, or `sinks` that
    are not None nor a floating mlx array of shape `(H_q,)`.
    """
    if not _usual(q, spec, scale, sinks):  # every layer of every step comes here: the usual call is settled at once
        _check(q, spec, scale, sinks)
    if sinks is not None and sinks.dtype != q.dtype:
        sinks = sinks.astype(q.dtype)
    if spec.groups is not None:
        return attend_groups(q, spec.groups, scale, sinks=sinks)
    keys, values = spec.keys, spec.values
    if spec.mask_kind is MaskKind.NONE or (spec.mask_kind is MaskKind.CAUSAL and q.shape[2] == 1):
        mask = None  # one query, causal: it sees every key (mlx-lm's decode passes no mask either)
    elif spec.mask_kind is MaskKind.CAUSAL:
        mask = "causal"
    else:
        mask = spec.mask
    if isinstance(keys, QuantizedKV):
        return quantized_attention(q, keys, values, scale, mask, sinks=sinks)
    if keys.dtype != q.dtype:
        keys, values = keys.astype(q.dtype), values.astype(q.dtype)
    return sdpa(q, keys, values, scale, mask, sinks)


def sdpa(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any, sinks: mx.array | None) -> mx.array:
    """MLX's fused attention, handed `sinks` only when there are some: passing `sinks=None` costs the
    call ~3 us more on the host (every layer, every step)."""
    if sinks is None:
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask, sinks=sinks)


def quantized_attention(
    q: mx.array, keys: QuantizedKV, values: QuantizedKV, scale: float, mask: Any, *, sinks: mx.array | None = None
) -> mx.array:
    """Attention of `q` `[B, H_q, T, D]` over quantized `keys`/`values` `[B or 1, H_kv, S, D]`,
    multiplying the packed triples in place with `mx.quantized_matmul` (nothing is dequantized).

    `mask`: None, "causal" (lower-right aligned, as MLX's) or bool `[B or 1, 1, T, S]`. The
    order of operations is mlx-lm's quantized SDPA (scale the queries, masked scores at the
    dtype's lowest finite value, a precise softmax), so one sequence gives mlx-lm's
    QuantizedKVCache result bit for bit. GQA: a KV head's `H_q / H_kv` query heads share its
    product, as a broadcast axis, never a copy of the keys. `sinks` (optional, `[H_q]`): each
    query head's sink logit joins the softmax as one more column, dropped before the values
    (see `attend`); None adds no op.
    """
    batch, h_q, t, d = q.shape
    h_kv = keys.packed.shape[1]
    rep = h_q // h_kv
    q = q * scale
    if rep > 1:
        q = q.reshape(batch, h_kv, rep, t, d)  # [B, H_kv, rep, T, D]
        keys, values = (x.map(lambda a: mx.expand_dims(a, -3)) for x in (keys, values))  # [., H_kv, 1, S, .]
    bits, group = keys.bits, keys.group_size
    s = mx.quantized_matmul(q, *keys.parts(), transpose=True, group_size=group, bits=bits)  # [B, H_kv, (rep,) T, S]
    if isinstance(mask, str):  # "causal": query i sees keys up to S - T + i
        slots = s.shape[-1]
        mask = mx.arange(slots - t, slots)[:, None] >= mx.arange(slots)[None]  # [T, S]
    if mask is not None:
        if rep > 1 and mask.ndim == 4:
            mask = mx.expand_dims(mask, -3)  # [., 1, 1, T, S]: every query head of a KV head
        s = mx.where(mask, s, mx.finfo(s.dtype).min)
    p = _softmax(s, sinks)  # s's axes 1..-3 are (H_kv, rep) or (H_q,): query head h = kv * rep + r
    o = mx.quantized_matmul(p, *values.parts(), transpose=False, group_size=group, bits=bits)  # [B, H_kv, (rep,) T, D]
    return o.reshape(batch, h_q, t, d).astype(q.dtype)


def _usual(q: Any, spec: Any, scale: Any, sinks: Any) -> bool:
    """Whether `attend`'s arguments are the usual ones that `_check` passes, settled in a few comparisons:
    a layout's spec over plain float keys (any mask kind, grouped or not) with T queries, no sinks.
    False says nothing: `_check` decides."""
    if not (sinks is None and type(spec) is AttendSpec and type(q) is mx.array and type(scale) is float):
        return False
    # The keys read: the groups' own when set (the spec's dense ones may be made only when asked for).
    keys = spec.keys if spec.groups is None else spec.groups.keys
    if not (type(keys) is mx.array and q.ndim == 4 and q.dtype in FLOATING and math.isfinite(scale)):
        return False
    batch, h_q, t, d = q.shape
    k_batch, h_kv, slots, k_d = keys.shape
    return (batch == k_batch and d == k_d and h_q >= h_kv and not h_q % h_kv and t == spec.queries
            and (t <= slots or spec.mask_kind is not MaskKind.CAUSAL))


def _check(q: Any, spec: Any, scale: Any, sinks: Any = None) -> None:
    """What `attend` refuses (see there), before MLX would raise its own ValueError or broadcast."""
    if not isinstance(spec, AttendSpec):
        raise StepError(f"spec: expected an AttendSpec (what update_and_fetch returns), got {type(spec).__name__}")
    if not isinstance(q, mx.array) or q.ndim != 4 or q.dtype not in FLOATING:
        got = f"{type(q).__name__} {tuple(q.shape)} {q.dtype}" if isinstance(q, mx.array) else type(q).__name__
        raise StepError(f"q: expected a floating mlx array [1, H_q, T, D], got {got}")
    batch, h_q, t, d = q.shape
    keys = spec.keys.shape  # [1, H_kv, S, D]
    if batch != keys[0] or d != keys[3] or h_q < keys[1] or h_q % keys[1]:
        raise StepError(
            f"q of shape {tuple(q.shape)}: expected [{keys[0]}, a multiple of H_kv={keys[1]}, T, {keys[3]}] "
            f"against keys of shape {tuple(keys)}"
        )
    if spec.queries is not None and t != spec.queries:
        raise StepError(f"q holds T={t} queries for a step of {spec.queries} token(s): expected T={spec.queries}")
    if spec.mask_kind is MaskKind.CAUSAL and t > keys[2]:
        raise StepError(f"q holds T={t} queries, more than the {keys[2]} keys of a causal step")
    if not (type(scale) is float and math.isfinite(scale)) and not finite(scale):  # an mx.array: refused too
        raise StepError(f"scale={scale!r}: expected a finite number")
    if sinks is not None:
        _check_sinks(sinks, h_q)


def _check_sinks(sinks: Any, h_q: int) -> None:
    """Sinks are one floating logit per query head; MLX would broadcast a scalar or fail late on the rest."""
    if not isinstance(sinks, mx.array) or sinks.shape != (h_q,) or not mx.issubdtype(sinks.dtype, mx.floating):
        got = f"{tuple(sinks.shape)} {sinks.dtype}" if isinstance(sinks, mx.array) else type(sinks).__name__
        raise StepError(
            f"sinks: expected None or a floating mlx array of shape ({h_q},) (one logit per query head), got {got}"
        )


def _softmax(s: mx.array, sinks: mx.array | None) -> mx.array:
    """The precise softmax over `s`'s last axis, with a sink column when `sinks` `[H_q]` are given.

    `s`'s axes 1 to -3 are the query heads: `(H_q,)`, or `(H_kv, rep)` with query head
    h = kv * rep + r (GQA), so `sinks` reshaped to them broadcast over the batch and query
    axes. The sink's column is appended and its probability dropped: it weighs no value.
    """
    if sinks is None:
        return mx.softmax(s, axis=-1, precise=True)
    col = mx.broadcast_to(sinks.astype(s.dtype).reshape(*s.shape[1:-2], 1, 1), (*s.shape[:-1], 1))
    return mx.softmax(mx.concatenate([s, col], axis=-1), axis=-1, precise=True)[..., :-1]


def attend_groups(q: mx.array, groups: AttendGroups, scale: float, *, sinks: mx.array | None = None) -> mx.array:
    """The dense EXPLICIT result, computed group by group, one batch of groups at a time.

    A gathered batch (`page` 0) takes each group's K/V rows from
    `groups.keys`/`values` (one `mx.take` per array, straight into
    `[G, H_kv, Kg, D]`) and its queries likewise, and runs one
    `scaled_dot_product_attention` with the groups on the batch axis. A paged
    batch (`page` B) reads whole pages of B cells where they lie and gathers
    only its tail (`_attend_pages`). Outputs go back to token order. A plan
    `in_order` (a decode step's, usually) reads each batch's queries as a
    run of q's token axis and its outputs land in token order already, so
    neither is gathered: for one-query groups both are views.
    Work: G * Qg * Kg query-key pairs (plus G * Kg gathered rows), instead of
    T * S for the dense mask (the layout picks the cheapest; see its rule).
    `sinks` (optional, `[H_q]`, see `attend`) join every batch's softmax, gathered or paged;
    they are cast to q's dtype, as the fused attention requires.
    """
    if sinks is not None and sinks.dtype != q.dtype:
        sinks = sinks.astype(q.dtype)
    outs, first = [], 0
    for b in groups.batches():
        n_groups, q_len = b.tokens.shape
        # In order: the batch's queries are tokens [first, first + G * Qg), a slice (a view) of q.
        qg = _run_queries(q, first, n_groups, q_len) if groups.in_order else _group_queries(q, b.tokens)
        outs.append(_ungroup(_attend_batch(qg, groups.keys, groups.values, b, scale, sinks)))  # [1, H_q, G_b * Q_b, D]
        first += n_groups * q_len
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)  # [1, H_q, sum G_b * Q_b, D]
    return o if groups.in_order else mx.take(o, groups.out, axis=2)  # [1, H_q, T, D]


def _attend_batch(
    qg: mx.array, keys: mx.array, values: mx.array, b: AttendBatch, scale: float, sinks: mx.array | None = None
) -> mx.array:
    """One batch of groups, its queries `qg` `[G, H_q, Qg, D]`: outputs `[G, H_q, Qg, D]`; `sinks` `[H_q]` or None."""
    slots = keys.shape[2]
    cells = b.cells
    quantized = isinstance(keys, QuantizedKV)
    if b.page:
        if slots % b.page:
            raise ShapeError(f"pages of {b.page} cells do not tile the {slots} slots of keys")
        if not quantized and keys.dtype == qg.dtype and pages_in_place(keys.dtype):
            return _attend_pages(qg, keys, values, b, scale, sinks)
        # Storage narrower than q, or pages this device cannot read in place: gather the pages'
        # cells and the tail (casting only those, as dense would); the result is the same.
        cells = (cells[:, :, None] * b.page + mx.arange(b.page, dtype=cells.dtype)).reshape(cells.shape[0], -1)
        if b.tail is not None:
            cells = mx.concatenate([cells, b.tail.astype(cells.dtype)], axis=1)  # [G, P * B + Kt]
    if quantized:  # the triples' rows, a quarter to an eighth of float32's bytes
        k, v = (x.map(lambda a: _take_rows(a, cells)) for x in (keys, values))  # [G, H_kv, Kg, .] parts
        return quantized_attention(qg, k, v, scale, b.mask, sinks=sinks)
    k, v = _gather(keys, values, cells)  # [G, H_kv, Kg, D] each
    if k.dtype != qg.dtype:  # cast only what was gathered
        k, v = k.astype(qg.dtype), v.astype(qg.dtype)
    return sdpa(qg, k, v, scale, b.mask, sinks)


def _group_queries(q: mx.array, tokens: mx.array) -> mx.array:
    """The queries of `tokens` `[G, Qg]` (indices on q's token axis), group-major: `[G, H_q, Qg, D]`."""
    _, h_q, _, d = q.shape  # [1, H_q, T, D]
    n_groups, q_len = tokens.shape
    qg = mx.take(q, tokens.reshape(-1), axis=2)  # [1, H_q, G * Qg, D]
    return qg.reshape(h_q, n_groups, q_len, d).transpose(1, 0, 2, 3)  # [G, H_q, Qg, D]


def _run_queries(q: mx.array, first: int, n_groups: int, q_len: int) -> mx.array:
    """Tokens `[first, first + G * Qg)` of q `[1, H_q, T, D]` as G groups of Qg: `[G, H_q, Qg, D]`, a view."""
    _, h_q, t, d = q.shape
    if q_len == 1:  # views only: a model's [1, T, H_q, D] queries are then read where they lie
        run = q if first == 0 and n_groups == t else q[:, :, first : first + n_groups, :]  # [1, H_q, G, D]
        return run.transpose(2, 1, 0, 3)  # [G, H_q, 1, D]: one op (each is host time, every layer)
    run = q[0, :, first : first + n_groups * q_len, :]  # [H_q, G * Qg, D]
    return run.reshape(h_q, n_groups, q_len, d).transpose(1, 0, 2, 3)


def _ungroup(o: mx.array) -> mx.array:
    """`[G, H_q, Qg, D]` outputs back on one token axis, group-major: `[1, H_q, G * Qg, D]`."""
    n_groups, h_q, q_len, d = o.shape
    if q_len == 1:  # a view: [G, H_q, D] is already the [1, T, H_q * D] layout a model's o_proj reads
        return o.transpose(2, 1, 0, 3)  # [1, H_q, G, D]
    return o.transpose(1, 0, 2, 3).reshape(1, h_q, n_groups * q_len, d)


def pages_in_place(dtype: mx.Dtype) -> bool:
    """Whether `attend_groups` reads pages of `dtype` in place on the default device.

    MLX's `gather_mm` runs float32 only on the CPU (0.32: "Currently only
    supports float32"), and the paged path is measured on the CPU only; GPU
    backends gather the pages' cells instead until it is measured there.
    Layouts ask this before planning pages under their automatic rule.
    """
    return dtype == mx.float32 and mx.default_device() == mx.cpu


def _gather(keys: mx.array, values: mx.array, cells: mx.array) -> tuple[mx.array, mx.array]:
    """Rows of `cells` `[G, K]` from both pools, as `[G, H_kv, K, D]`."""
    rows = _row_indices(keys, cells)  # the pools have one shape: one index array for both
    k = _take_flat(keys, rows)  # [G, H_kv, K, D]
    with mx.stream(_side_stream()):  # V's gather beside K's: a gather runs on one core (the CPU build)
        v = _take_flat(values, rows)
    return k, v


def _take_rows(a: mx.array, cells: mx.array) -> mx.array:
    """Rows of `cells` `[G, K]` from `a` `[1, H, S, W]`, as `[G, H, K, W]`."""
    return _take_flat(a, _row_indices(a, cells))


def _row_indices(a: mx.array, cells: mx.array) -> mx.array:
    """Row of (head h, cell c) in `a` `[1, H, S, W]` viewed as `[H * S, W]` (free when `a` is
    row-contiguous), for `cells` `[G, K]`: `[G, H, K]`.

    Every layer of a window gathers by the same `cells` array (a plan's) from pools of one shape: the
    rows are made once and found again by that array's identity (held, so it is never another's)."""
    _, heads, slots, _ = a.shape
    held = getattr(_ROWS, "last", None)
    if held is not None and held[0] is cells and held[1] == heads and held[2] == slots:
        return held[3]
    rows = cells[:, None, :] + (mx.arange(heads, dtype=mx.int32) * slots)[None, :, None]  # [G, H, K]
    _ROWS.last = (cells, heads, slots, rows)
    return rows


_ROWS = threading.local()  # the last (cells, heads, slots, rows) of `_row_indices`, per thread (arrays are its)


def _take_flat(a: mx.array, rows: mx.array) -> mx.array:
    """`a` `[1, H, S, W]`'s rows `rows` `[G, H, K]` (from `_row_indices`), as `[G, H, K, W]`."""
    return mx.take(a.reshape(-1, a.shape[-1]), rows, axis=0)


def _attend_pages(
    qg: mx.array, keys: mx.array, values: mx.array, b: AttendBatch, scale: float, sinks: mx.array | None = None
) -> mx.array:
    """A paged batch of grouped queries `qg` `[G, H_q, Qg, D]`: each group attends P whole pages of
    B cells, read in place, and its gathered tail; outputs `[G, H_q, Qg, D]`.

    The pool `[1, H_kv, S, D]` viewed as `[H_kv, S / B, B, D]` is a
    reshape of a row-contiguous buffer, so no byte of it is copied:
    `gather_mm` multiplies each (group, page, head)'s queries with that page's
    keys, the tail's scores (gathered K) join them, one softmax runs over the
    group's P * B + Kt slots (foreign cells and padding masked), and a second
    `gather_mm` weighs the pages' values (the tail's with one matmul). Queries
    of one KV head (GQA: q head h reads KV head h // (H_q / H_kv)) share each
    product, as in the fused SDPA. `sinks` `[H_q]` (or None): each query head's sink joins the
    softmax as one more column (the scores viewed `[G, H_kv, rep, Qg, .]` for it), then dropped.
    """
    _, h_kv, slots, d = keys.shape  # [1, H_kv, S, D]
    n_groups, h_q, q_len, _ = qg.shape
    page, n_pages = b.page, b.cells.shape[1]
    rows = h_q // h_kv * q_len  # query rows per KV head: rep * Qg
    k_pages = keys.reshape(h_kv, slots // page, page, d)  # [H_kv, S / B, B, D], a view
    v_pages = values.reshape(h_kv, slots // page, page, d)
    # Index of (head h, page p) among k_pages' [H_kv * S / B] matrices, for each group's pages.
    kv_at = (b.cells.astype(mx.uint32)[:, :, None]
             + (mx.arange(h_kv, dtype=mx.uint32) * (slots // page))[None, None, :])  # [G, P, H_kv]
    qg = (qg * scale).reshape(n_groups, h_kv, rows, d)  # [G, H_kv, rep * Qg, D]
    q_at = mx.broadcast_to(
        mx.arange(n_groups * h_kv, dtype=mx.uint32).reshape(n_groups, 1, h_kv), kv_at.shape
    )  # [G, P, H_kv]
    s = mx.gather_mm(qg.reshape(-1, rows, d), k_pages.swapaxes(-1, -2), q_at, kv_at)  # [G, P, H_kv, rep*Qg, B]
    s = s.transpose(0, 2, 3, 1, 4).reshape(n_groups, h_kv, rows, n_pages * page)  # [G, H_kv, rep*Qg, P*B]
    if b.tail is not None:
        k_tail, v_tail = _gather(keys, values, b.tail)  # [G, H_kv, Kt, D] each
        s = mx.concatenate([s, qg @ k_tail.swapaxes(-1, -2)], axis=-1)  # [G, H_kv, rep*Qg, P*B + Kt]
    if b.mask is not None:  # [G, 1, Qg, P*B + Kt], for each of a KV head's rep query heads
        s = mx.where(b.mask[:, :, None], s.reshape(n_groups, h_kv, -1, q_len, s.shape[-1]), -mx.inf)
    if sinks is not None:  # query head h = kv * rep + r: its rows are [r * Qg, (r + 1) * Qg) of KV head kv
        s = s.reshape(n_groups, h_kv, -1, q_len, s.shape[-1])  # [G, H_kv, rep, Qg, P*B + Kt]
    p = _softmax(s, sinks).reshape(n_groups, h_kv, rows, -1)
    p_pages = p[..., : n_pages * page].reshape(n_groups, h_kv, rows, n_pages, page)
    p_pages = p_pages.transpose(0, 3, 1, 2, 4).reshape(-1, rows, page)  # [G * P * H_kv, rep*Qg, B]
    p_at = mx.arange(n_groups * n_pages * h_kv, dtype=mx.uint32).reshape(kv_at.shape)
    o = mx.gather_mm(p_pages, v_pages, p_at, kv_at).sum(axis=1)  # [G, H_kv, rep*Qg, D]
    if b.tail is not None:
        o = o + p[..., n_pages * page :] @ v_tail  # [G, H_kv, rep*Qg, D]
    return o.reshape(n_groups, h_q, q_len, d)  # [G, H_q, Qg, D]


# device -> a second stream on it, per thread: MLX's streams belong to the thread that made them
# (a server steps its engine on a thread of its own; another thread's stream is not there).
_SIDE = threading.local()


def _side_stream() -> mx.Stream:
    """A second stream on the default device, made once: the two gathers of a batch run at once.

    The gather is a copy that MLX's CPU build runs on one thread per stream, so on two
    cores gathering V on its own stream cuts the gather's wall time by about a third
    (32 groups x 1k cells, H_kv=8, D=128: ~195 ms -> ~137 ms); MLX orders the SDPA after both.
    """
    device = mx.default_device()
    last = getattr(_SIDE, "last", None)  # (device, its stream): asked every layer, the device rarely changes
    if last is not None and last[0] == device:
        return last[1]
    streams = _SIDE.__dict__.setdefault("streams", {})
    key = str(device)
    if key not in streams:
        streams[key] = mx.new_stream(device)
    _SIDE.last = (device, streams[key])
    return streams[key]
