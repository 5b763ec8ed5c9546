"""attend(sinks=...): gpt-oss's attention sinks on every path, against a float64 numpy softmax.

A sink is one learned logit per query head that joins each query's softmax denominator and weighs
no value. The oracle (`reference`) appends it as a column of the masked scores, takes the softmax
in float64, drops the column and weighs V; it never calls the code under test. Every case runs
through `attend()`: dense (no mask, causal, explicit, narrow storage), quantized K/V, and the
grouped paths (gathered groups, paged batches in place with and without a tail, paged half
storage gathered instead, quantized groups gathered and paged). GQA (H_q = 4, H_kv = 2) throughout,
with a different sink per query head so that a head read from the wrong KV head's row shows.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest

from kvlayout import AttendBatch, AttendGroups, AttendSpec, MaskKind, StepError
from kvlayout.mlx import attend
from kvlayout.mlx.attention import attend_groups, pages_in_place, quantized_attention
from tests.core.test_quantized_kv import filled_pools, oracle

H_Q, H_KV, D = 4, 2, 8
SCALE = D**-0.5
SINKS = np.array([-2.0, 0.5, 2.5, 1.0], dtype=np.float32)  # one per query head, all different


def reference(q, k, v, allowed, scale, sinks=None) -> np.ndarray:
    """float64 softmax([q k^T * scale masked, sink]) without the sink's column, times v.
    `q` `[1, H_q, T, D]`, `k`/`v` `[1, H_kv, S, D]`, `allowed` bool `[T, S]`; query head h reads
    KV head h // (H_q / H_kv) and has sink `sinks[h]`."""
    _, hq, t, _ = q.shape
    rep = hq // k.shape[1]
    out = np.zeros(q.shape, dtype=np.float64)
    for h in range(hq):
        kh, vh = (np.asarray(x[0, h // rep], dtype=np.float64) for x in (k, v))
        scores = np.where(allowed, np.asarray(q[0, h], dtype=np.float64) @ kh.T * scale, -np.inf)  # [T, S]
        if sinks is not None:
            scores = np.concatenate([scores, np.full((t, 1), float(sinks[h]))], axis=1)  # [T, S + 1]
        w = np.exp(scores - scores.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        out[0, h] = (w[:, :-1] if sinks is not None else w) @ vh
    return out


def i32(rows) -> mx.array:
    return mx.array(np.array(rows, dtype=np.int32))


def qkv(rng, t, s, d=D):
    q = rng.normal(size=(1, H_Q, t, d)).astype(np.float32)
    k = rng.normal(size=(1, H_KV, s, d)).astype(np.float32)
    v = rng.normal(size=(1, H_KV, s, d)).astype(np.float32)
    return q, k, v


def dense(rng, kind, t, s, storage=np.float32):
    q, k, v = qkv(rng, t, s)
    k, v = k.astype(storage), v.astype(storage)
    mask = None
    if kind is MaskKind.NONE:
        allowed = np.ones((t, s), dtype=bool)
    elif kind is MaskKind.CAUSAL:  # lower-right aligned
        allowed = np.arange(s)[None, :] <= (s - t + np.arange(t))[:, None]
    else:
        allowed = rng.random((t, s)) < 0.5
        allowed[np.arange(t), rng.integers(0, s, size=t)] = True  # every row attends something
        mask = mx.array(allowed[None, None])
    return q, AttendSpec(mx.array(k), mx.array(v), kind, mask, queries=t), allowed, k, v, SCALE


def quantized(rng, kind, bits, t=3, s=11, d=64):
    kp, vp = filled_pools(rng, H_KV, s, d, bits, 64)
    keys, values = kp.read(0, s), vp.read(0, s)
    q, spec, allowed, _, _, _ = dense(rng, kind, t, s)
    q = rng.normal(size=(1, H_Q, t, d)).astype(np.float32)
    return q, attrs.evolve(spec, keys=keys, values=values), allowed, oracle(keys), oracle(values), d**-0.5


def grouped(keys, values, groups, allowed, t):
    """A spec whose groups replace the dense mask `allowed` `[T, S]`."""
    return AttendSpec(keys, values, MaskKind.EXPLICIT, mx.array(allowed[None, None]), groups, queries=t)


def gathered_groups(rng, storage=np.float32):
    # 5 tokens in 2 groups of 3 over 9 cells (a padded query slot, a masked padding cell)
    q, k, v = qkv(rng, 5, 9)
    k, v = k.astype(storage), v.astype(storage)
    tokens, cells = np.array([[0, 3, 3], [1, 2, 4]]), np.array([[2, 5, 0], [1, 7, 8]])
    gmask = np.array([[[1, 0, 0], [1, 1, 0], [1, 1, 0]], [[1, 0, 0], [1, 1, 0], [1, 1, 1]]], dtype=bool)
    allowed = np.zeros((5, 9), dtype=bool)
    for g, i, j in zip(*np.nonzero(gmask)):
        allowed[tokens[g, i], cells[g, j]] = True
    groups = AttendGroups(
        i32(tokens), i32(cells), mx.array(gmask)[:, None], i32([0, 3, 4, 1, 5]), mx.array(k), mx.array(v)
    )
    return q, grouped(mx.array(k), mx.array(v), groups, allowed, 5), allowed, k, v, SCALE


def paged_tail(keys, values, t_q=None):
    """3 tokens over 12 cells in pages of 4, two queries a group, each group with a gathered tail:
    token 0 and 2 read pages 0 and 2 and tail cell 5 (masks differ), token 1 page 1 and tail cell 0
    (twice: its group pads with a repeat). Returns (groups, allowed)."""
    pmask = np.zeros((2, 2, 9), dtype=bool)  # [G, Qg, P * B + Kt]
    pmask[0, 0, [0, 1, 4, 8]] = True  # token 0: cells 0, 1, 8 and tail 5
    pmask[0, 1, [0, 2, 4, 5, 6]] = True  # token 2: cells 0, 2, 8, 9, 10
    pmask[1, :, [1, 3, 8]] = True  # token 1: cells 5, 7 and tail 0
    allowed = np.zeros((3, 12), dtype=bool)
    allowed[0, [0, 1, 8, 5]] = allowed[2, [0, 2, 8, 9, 10]] = allowed[1, [5, 7, 0]] = True
    groups = AttendGroups(
        i32([[0, 2], [1, 1]]),
        i32([[0, 2], [1, 1]]),
        mx.array(pmask)[:, None],
        i32([0, 2, 1]),
        keys,
        values,
        page=4,
        tail=i32([[5], [0]]),
    )
    return groups, allowed


def paged(rng, storage=np.float32):
    q, k, v = qkv(rng, 3, 12)
    k, v = k.astype(storage), v.astype(storage)
    groups, allowed = paged_tail(mx.array(k), mx.array(v))
    return q, grouped(mx.array(k), mx.array(v), groups, allowed, 3), allowed, k, v, SCALE


def paged_unmasked(rng):
    # 4 tokens, 2 groups of 2, no mask: group 0 (tokens 0, 1) reads page 0 and tail cells 9, 10;
    # group 1 (tokens 2, 3) page 1 and tail cells 1, 11. Beside them a gathered batch for token 4.
    q, k, v = qkv(rng, 5, 12)
    more = (AttendBatch(i32([[4]]), i32([[3, 6, 8]]), None),)
    groups = AttendGroups(
        i32([[0, 1], [2, 3]]),
        i32([[0], [1]]),
        None,
        i32([0, 1, 2, 3, 4]),
        mx.array(k),
        mx.array(v),
        more=more,
        page=4,
        tail=i32([[9, 10], [1, 11]]),
    )
    allowed = np.zeros((5, 12), dtype=bool)
    allowed[:2, [0, 1, 2, 3, 9, 10]] = allowed[2:4, [4, 5, 6, 7, 1, 11]] = allowed[4, [3, 6, 8]] = True
    return q, grouped(mx.array(k), mx.array(v), groups, allowed, 5), allowed, k, v, SCALE


def quantized_groups(rng, bits, kind):
    d, slots = 64, 12
    kp, vp = filled_pools(rng, H_KV, slots, d, bits, 64)
    keys, values = kp.read(0, slots), vp.read(0, slots)
    if kind == "paged":
        groups, allowed = paged_tail(keys, values)
        t = 3
    else:
        _, spec, allowed, _, _, _ = gathered_groups(rng)
        groups, allowed = attrs.evolve(spec.groups, keys=keys, values=values), np.pad(allowed, ((0, 0), (0, 3)))
        t = 5
    q = rng.normal(size=(1, H_Q, t, d)).astype(np.float32)
    return q, grouped(keys, values, groups, allowed, t), allowed, oracle(keys), oracle(values), d**-0.5


CASES = {
    "dense-none": lambda rng: dense(rng, MaskKind.NONE, 3, 7),
    "dense-causal": lambda rng: dense(rng, MaskKind.CAUSAL, 4, 9),
    "dense-causal-decode": lambda rng: dense(rng, MaskKind.CAUSAL, 1, 6),  # one query: no mask at all
    "dense-explicit": lambda rng: dense(rng, MaskKind.EXPLICIT, 4, 7),
    "dense-float16-storage": lambda rng: dense(rng, MaskKind.CAUSAL, 3, 8, np.float16),
    "quantized-q4-none": lambda rng: quantized(rng, MaskKind.NONE, 4),
    "quantized-q8-causal": lambda rng: quantized(rng, MaskKind.CAUSAL, 8),
    "quantized-q4-explicit": lambda rng: quantized(rng, MaskKind.EXPLICIT, 4),
    "quantized-q8-decode": lambda rng: quantized(rng, MaskKind.CAUSAL, 8, t=1),
    "groups-gathered": gathered_groups,
    "groups-gathered-float16-storage": lambda rng: gathered_groups(rng, np.float16),
    "groups-paged-tail": paged,
    "groups-paged-unmasked-beside-gathered": paged_unmasked,
    "groups-paged-float16-storage": lambda rng: paged(rng, np.float16),  # gathered, not read in place
    "groups-quantized-q4-gathered": lambda rng: quantized_groups(rng, 4, "gathered"),
    "groups-quantized-q8-paged-tail": lambda rng: quantized_groups(rng, 8, "paged"),
}
QUANTIZED = {name for name in CASES if "quantized" in name}


def tolerance(name: str) -> float:
    return 1e-4 if name in QUANTIZED else 1e-5


def run(q, spec, scale, sinks=None) -> mx.array:
    out = attend(mx.array(q), spec, scale, sinks=None if sinks is None else mx.array(sinks))
    assert out.shape == q.shape and out.dtype == mx.float32
    return out


@pytest.mark.parametrize("name", CASES)
def test_sinks_join_every_softmax_on_every_path(rng, name):
    q, spec, allowed, k, v, scale = CASES[name](rng)
    got = np.array(run(q, spec, scale, SINKS))
    tol = tolerance(name)
    np.testing.assert_allclose(got, reference(q, k, v, allowed, scale, SINKS), atol=tol, rtol=tol)
    # the sinks mattered: the result without them is another one
    assert np.abs(got - reference(q, k, v, allowed, scale)).max() > 1e-3


@pytest.mark.parametrize("name", CASES)
def test_a_large_sink_changes_the_output_a_very_negative_one_does_not(rng, name):
    q, spec, _, _, _, scale = CASES[name](rng)
    plain = np.array(run(q, spec, scale))
    big = np.array(run(q, spec, scale, np.full(H_Q, 3.0, dtype=np.float32)))
    assert np.abs(big - plain).max() > 1e-3
    gone = np.array(run(q, spec, scale, np.full(H_Q, -1e9, dtype=np.float32)))
    np.testing.assert_allclose(gone, plain, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", CASES)
def test_no_sinks_is_the_sink_free_result_bit_for_bit(rng, name):
    q, spec, _, _, _, scale = CASES[name](rng)
    default = attend(mx.array(q), spec, scale)
    assert mx.array_equal(attend(mx.array(q), spec, scale, sinks=None), default).item()
    if name.startswith("dense-") and spec.mask_kind is not MaskKind.CAUSAL:  # today's dense call, by hand
        k, v = spec.keys.astype(mx.float32), spec.values.astype(mx.float32)
        want = mx.fast.scaled_dot_product_attention(mx.array(q), k, v, scale=scale, mask=spec.mask)
        assert mx.array_equal(default, want).item()
    if name.startswith("quantized-") and spec.mask_kind is MaskKind.NONE:  # quantized_attention with no sinks
        assert mx.array_equal(default, quantized_attention(mx.array(q), spec.keys, spec.values, scale, None)).item()


def test_paged_pages_are_read_in_place_with_sinks_and_agree_with_the_gathered_result(rng):
    # The paged float32 batch takes _attend_pages (its own softmax); the same cells gathered take
    # the fused attention with its sinks: the two must agree.
    assert pages_in_place(mx.float32)
    q, spec, _, _, _, scale = paged(rng)
    cells = i32([[0, 1, 2, 3, 8, 9, 10, 11, 5], [4, 5, 6, 7, 4, 5, 6, 7, 0]])
    gathered = attrs.evolve(spec.groups, cells=cells, page=0, tail=None)
    sinks = mx.array(SINKS)
    want = attend_groups(mx.array(q), gathered, scale, sinks=sinks)
    np.testing.assert_allclose(np.array(attend(mx.array(q), spec, scale, sinks=sinks)), np.array(want), atol=1e-6)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("name", ["dense-causal", "groups-gathered", "groups-paged-tail", "quantized-q8-causal"])
def test_half_precision_queries_take_float32_sinks_cast_to_their_dtype(rng, dtype, name):
    # MLX's fused attention refuses sinks that do not promote to q's dtype: attend casts them.
    q, spec, allowed, k, v, scale = CASES[name](rng)
    if not name.startswith("quantized-"):
        keys, values = spec.keys.astype(dtype), spec.values.astype(dtype)
        groups = None if spec.groups is None else attrs.evolve(spec.groups, keys=keys, values=values)
        spec = attrs.evolve(spec, keys=keys, values=values, groups=groups)
        k, v = np.array(keys.astype(mx.float32)), np.array(values.astype(mx.float32))
    qh = mx.array(q).astype(dtype)
    out = attend(qh, spec, scale, sinks=mx.array(SINKS))
    assert out.dtype == dtype
    q32 = np.array(qh.astype(mx.float32))
    sinks = np.array(mx.array(SINKS).astype(dtype).astype(mx.float32))
    np.testing.assert_allclose(
        np.array(out.astype(mx.float32)), reference(q32, k, v, allowed, scale, sinks), atol=3e-2, rtol=3e-2
    )


@pytest.mark.parametrize(
    "sinks, what",
    [
        (mx.array([1.0, 2.0]), r"\(2,\) mlx.core.float32"),  # one per KV head, not per query head
        (mx.zeros((H_Q, 1)), r"\(4, 1\) mlx.core.float32"),
        (mx.array(1.0), r"\(\) mlx.core.float32"),  # a scalar MLX would broadcast
        (mx.array([1, 2, 3, 4]), r"\(4,\) mlx.core.int32"),
        (mx.array([True, False, True, False]), r"\(4,\) mlx.core.bool"),
        ([1.0, 2.0, 3.0, 4.0], "got list"),
        (np.zeros(H_Q, dtype=np.float32), "got ndarray"),
    ],
)
@pytest.mark.parametrize("name", ["dense-none", "groups-paged-tail", "quantized-q4-none"])
def test_bad_sinks_are_refused_naming_them(rng, sinks, what, name):
    q, spec, _, _, _, scale = CASES[name](rng)
    with pytest.raises(StepError, match=r"sinks: expected None or a floating mlx array of shape \(4,\)") as err:
        attend(mx.array(q), spec, scale, sinks=sinks)
    assert err.match(what)
