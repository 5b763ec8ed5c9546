"""attend(): each MaskKind against a hand-written numpy softmax attention with GQA."""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest

from kvlayout import AttendBatch, AttendGroups, AttendSpec, MaskKind
from kvlayout.mlx import attend
from kvlayout.mlx.attention import attend_groups

H_Q, H_KV, D = 4, 2, 8
SCALE = D**-0.5


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """softmax(q k^T * scale, masked) v; query head h reads kv head h // (H_q / H_kv)."""
    _, hq, t, _ = q.shape
    out = np.zeros_like(q, dtype=np.float64)
    group = hq // k.shape[1]
    for h in range(hq):
        scores = q[0, h].astype(np.float64) @ k[0, h // group].astype(np.float64).T * SCALE  # [T, S]
        scores = np.where(allowed, scores, -np.inf)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out[0, h] = weights @ v[0, h // group].astype(np.float64)
    return out


def qkv(rng, t, s):
    q = rng.normal(size=(1, H_Q, t, D)).astype(np.float32)
    k = rng.normal(size=(1, H_KV, s, D)).astype(np.float32)
    v = rng.normal(size=(1, H_KV, s, D)).astype(np.float32)
    return q, k, v


def run(q, k, v, kind, mask=None):
    spec = AttendSpec(mx.array(k), mx.array(v), kind, None if mask is None else mx.array(mask[None, None]))
    out = attend(mx.array(q), spec, SCALE)
    assert out.shape == q.shape
    return np.array(out)


@pytest.mark.parametrize("t, s", [(1, 7), (5, 5), (3, 9)])
def test_none_attends_every_key(rng, t, s):
    q, k, v = qkv(rng, t, s)
    allowed = np.ones((t, s), dtype=bool)
    np.testing.assert_allclose(run(q, k, v, MaskKind.NONE), reference(q, k, v, allowed), atol=1e-5)


def test_each_query_head_reads_its_own_kv_group(rng):
    q, k, v = qkv(rng, 2, 4)
    v[0, 1] += 100.0  # kv head 1 serves query heads 2 and 3 only
    out = run(q, k, v, MaskKind.NONE)
    assert (out[0, :2] < 50).all() and (out[0, 2:] > 50).all()


@pytest.mark.parametrize("t, s", [(6, 6), (3, 8), (1, 5)])
def test_causal_is_lower_right_aligned(rng, t, s):
    q, k, v = qkv(rng, t, s)
    # query i is the token at position s - t + i: it sees keys j <= s - t + i
    allowed = np.array([[j <= s - t + i for j in range(s)] for i in range(t)])
    np.testing.assert_allclose(run(q, k, v, MaskKind.CAUSAL), reference(q, k, v, allowed), atol=1e-5)


def test_causal_of_one_query_equals_no_mask(rng):
    q, k, v = qkv(rng, 1, 6)
    np.testing.assert_allclose(run(q, k, v, MaskKind.CAUSAL), run(q, k, v, MaskKind.NONE), atol=1e-6)


def test_explicit_applies_the_given_mask(rng):
    q, k, v = qkv(rng, 4, 7)
    allowed = rng.random((4, 7)) < 0.5
    allowed[np.arange(4), rng.integers(0, 7, size=4)] = True  # every row attends something
    np.testing.assert_allclose(
        run(q, k, v, MaskKind.EXPLICIT, allowed), reference(q, k, v, allowed), atol=1e-5
    )


def test_explicit_sliding_window_mask_differs_from_causal(rng):
    t = s = 6
    q, k, v = qkv(rng, t, s)
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    window = (j <= i) & (j >= i - 1)
    out = run(q, k, v, MaskKind.EXPLICIT, window)
    np.testing.assert_allclose(out, reference(q, k, v, window), atol=1e-5)
    assert not np.allclose(out, run(q, k, v, MaskKind.CAUSAL), atol=1e-3)


def test_narrow_storage_is_computed_in_the_query_dtype(rng):
    q, k, v = qkv(rng, 3, 5)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    spec = AttendSpec(mx.array(k16), mx.array(v16), MaskKind.CAUSAL)
    out = attend(mx.array(q), spec, SCALE)
    assert out.dtype == mx.float32
    allowed = np.array([[j <= 2 + i for j in range(5)] for i in range(3)])
    np.testing.assert_allclose(np.array(out), reference(q, k16, v16, allowed), atol=1e-5)


def test_groups_attend_each_group_to_its_own_cells_only(rng):
    # 5 tokens in 2 groups over a store of 9 cells; the dense equivalent is `allowed`.
    q, k, v = qkv(rng, 5, 9)
    tokens = np.array([[0, 3, 3], [1, 2, 4]], dtype=np.int32)  # group 0 pads with its last token
    cells = np.array([[2, 5, 0], [1, 7, 8]], dtype=np.int32)  # group 0 pads with a masked cell
    gmask = np.array([[[1, 0, 0], [1, 1, 0], [1, 1, 0]], [[1, 0, 0], [1, 1, 0], [1, 1, 1]]], dtype=bool)
    out = np.array([0, 3, 4, 1, 5], dtype=np.int32)
    allowed = np.zeros((5, 9), dtype=bool)
    for g in range(2):
        for i in range(3):
            for j in range(3):
                if gmask[g, i, j]:
                    allowed[tokens[g, i], cells[g, j]] = True
    groups = AttendGroups(
        mx.array(tokens), mx.array(cells), mx.array(gmask)[:, None], mx.array(out), mx.array(k), mx.array(v)
    )
    got = np.array(attend_groups(mx.array(q), groups, SCALE))
    np.testing.assert_allclose(got, reference(q, k, v, allowed), atol=1e-5)
    # a spec carrying groups takes that path; its dense fields are the same computation
    spec = AttendSpec(mx.array(k), mx.array(v), MaskKind.EXPLICIT, mx.array(allowed[None, None]), groups)
    np.testing.assert_allclose(np.array(attend(mx.array(q), spec, SCALE)), got, atol=1e-6)
    np.testing.assert_allclose(run(q, k, v, MaskKind.EXPLICIT, allowed), got, atol=1e-5)


def test_groups_without_a_mask_attend_every_gathered_cell(rng):
    q, k, v = qkv(rng, 2, 6)
    cells = np.array([[0, 2, 4], [1, 3, 5]], dtype=np.int32)
    groups = AttendGroups(
        mx.array(np.array([[1], [0]], dtype=np.int32)), mx.array(cells), None,
        mx.array(np.array([1, 0], dtype=np.int32)), mx.array(k.astype(np.float16)), mx.array(v.astype(np.float16)),
    )
    allowed = np.array([[0, 1, 0, 1, 0, 1], [1, 0, 1, 0, 1, 0]], dtype=bool)
    got = attend_groups(mx.array(q), groups, SCALE)
    assert got.dtype == mx.float32
    ref = reference(q, k.astype(np.float16), v.astype(np.float16), allowed)
    np.testing.assert_allclose(np.array(got), ref, atol=1e-5)


@pytest.mark.parametrize("q_len", [1, 2])
def test_groups_in_order_take_each_batch_s_queries_as_a_run_and_answer_in_token_order(rng, q_len):
    # Two batches of full groups whose slots are the tokens 0..T-1 in order: batch 0 holds 2 groups
    # (tokens 0..2*q_len-1), batch 1 the third (the last q_len). No `out` gather, no query gather.
    t = 3 * q_len
    q, k, v = qkv(rng, t, 12)
    cells = [np.array([[0, 1, 2], [3, 4, 5]], dtype=np.int32), np.array([[6, 7, 8, 9, 10]], dtype=np.int32)]
    tokens = [np.arange(2 * q_len, dtype=np.int32).reshape(2, q_len), np.arange(2 * q_len, t, dtype=np.int32)[None]]
    allowed = np.zeros((t, 12), dtype=bool)
    for toks, cs in zip(tokens, cells):
        for g in range(toks.shape[0]):
            allowed[np.ix_(toks[g], cs[g])] = True
    second = AttendBatch(mx.array(tokens[1]), mx.array(cells[1]), None)
    groups = AttendGroups(mx.array(tokens[0]), mx.array(cells[0]), None, mx.array(np.arange(t, dtype=np.int32)),
                          mx.array(k), mx.array(v), more=(second,), in_order=True)
    want = reference(q, k, v, allowed)
    np.testing.assert_allclose(np.array(attend_groups(mx.array(q), groups, SCALE)), want, atol=1e-5)
    # the same plan read by its tokens and `out` (in_order unset) gives the same result
    gathered = attrs.evolve(groups, in_order=False)
    np.testing.assert_allclose(np.array(attend_groups(mx.array(q), gathered, SCALE)), want, atol=1e-5)


def test_paged_groups_read_whole_pages_with_foreign_cells_masked(rng):
    # 3 tokens in 2 groups over a store of 12 cells in pages of 4; group 0 reads pages 0 and 2,
    # group 1 page 1 (padded with a second, fully masked copy of it).
    q, k, v = qkv(rng, 3, 12)
    tokens = np.array([[0, 2], [1, 1]], dtype=np.int32)
    pages = np.array([[0, 2], [1, 1]], dtype=np.int32)
    pmask = np.zeros((2, 2, 8), dtype=bool)
    pmask[0, 0, [0, 1, 4]] = True  # token 0: cells 0, 1, 8
    pmask[0, 1, [0, 1, 4, 5, 6]] = True  # token 2: cells 0, 1, 8, 9, 10
    pmask[1, :, [1, 3]] = True  # token 1: cells 5, 7 (both query slots: the padding repeats it)
    allowed = np.zeros((3, 12), dtype=bool)
    allowed[0, [0, 1, 8]] = allowed[2, [0, 1, 8, 9, 10]] = allowed[1, [5, 7]] = True
    out = np.array([0, 2, 1], dtype=np.int32)
    groups = AttendGroups(
        mx.array(tokens), mx.array(pages), mx.array(pmask)[:, None], mx.array(out), mx.array(k), mx.array(v), page=4
    )
    got = np.array(attend_groups(mx.array(q), groups, SCALE))
    np.testing.assert_allclose(got, reference(q, k, v, allowed), atol=1e-5)
    # narrower storage than q: the pages' cells are gathered and cast, same result as the dense path
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    half = AttendGroups(
        mx.array(tokens), mx.array(pages), mx.array(pmask)[:, None], mx.array(out), mx.array(k16), mx.array(v16),
        page=4,
    )
    got16 = attend_groups(mx.array(q), half, SCALE)
    assert got16.dtype == mx.float32
    np.testing.assert_allclose(np.array(got16), reference(q, k16, v16, allowed), atol=1e-5)


def test_a_paged_batch_beside_a_gathered_one_lands_each_output_in_token_order(rng):
    # tokens 0 and 1 read pages 0 and 1 (cells 0-3, 4-7) unmasked; token 2 gathers cells 3 and 6
    q, k, v = qkv(rng, 3, 8)
    i32 = lambda rows: mx.array(np.array(rows, dtype=np.int32))  # noqa: E731
    gathered = AttendBatch(i32([[2]]), i32([[3, 6]]), None)
    groups = AttendGroups(
        i32([[0], [1]]), i32([[0], [1]]), None, i32([0, 1, 2]), mx.array(k), mx.array(v), more=(gathered,), page=4
    )
    allowed = np.zeros((3, 8), dtype=bool)
    allowed[0, :4] = allowed[1, 4:] = allowed[2, [3, 6]] = True
    got = np.array(attend_groups(mx.array(q), groups, SCALE))
    np.testing.assert_allclose(got, reference(q, k, v, allowed), atol=1e-5)


def test_pages_that_do_not_tile_the_store_are_refused(rng):
    q, k, v = qkv(rng, 1, 10)
    groups = AttendGroups(
        mx.array(np.array([[0]], dtype=np.int32)), mx.array(np.array([[0]], dtype=np.int32)), None,
        mx.array(np.array([0], dtype=np.int32)), mx.array(k), mx.array(v), page=4,
    )
    with pytest.raises(ValueError, match="pages of 4 cells do not tile the 10 slots"):
        attend_groups(mx.array(q), groups, SCALE)


def test_a_paged_batch_gathers_its_tail_beside_its_pages(rng):
    # 2 tokens, one group each, store of 8 cells in pages of 4. Token 0 reads page 0 (cells 0-3, cell 2
    # masked) and gathers cell 6; token 1 reads page 1 (cells 4-7) and gathers cell 1 and a masked pad.
    q, k, v = qkv(rng, 2, 8)
    i32 = lambda rows: mx.array(np.array(rows, dtype=np.int32))  # noqa: E731
    pmask = np.array([[[1, 1, 0, 1, 1, 0]], [[1, 1, 1, 1, 1, 0]]], dtype=bool)  # [G, Q, P * B + Kt]
    groups = AttendGroups(
        i32([[0], [1]]), i32([[0], [1]]), mx.array(pmask)[:, None], i32([0, 1]), mx.array(k), mx.array(v),
        page=4, tail=i32([[6, 0], [1, 3]]),
    )
    allowed = np.zeros((2, 8), dtype=bool)
    allowed[0, [0, 1, 3, 6]] = allowed[1, [4, 5, 6, 7, 1]] = True
    got = np.array(attend_groups(mx.array(q), groups, SCALE))
    np.testing.assert_allclose(got, reference(q, k, v, allowed), atol=1e-5)
    half = attrs.evolve(groups, keys=mx.array(k.astype(np.float16)), values=mx.array(v.astype(np.float16)))
    ref16 = reference(q, k.astype(np.float16), v.astype(np.float16), allowed)
    np.testing.assert_allclose(np.array(attend_groups(mx.array(q), half, SCALE)), ref16, atol=1e-5)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_pages_are_gathered_where_gather_mm_cannot_read_them(rng, dtype):
    # MLX's CPU gather_mm is float32 only: a paged batch in half precision (q and pools alike)
    # must still give the gathered result, not fail when evaluated.
    from kvlayout.mlx.attention import pages_in_place

    assert pages_in_place(mx.float32) is (mx.default_device() == mx.cpu) and not pages_in_place(dtype)
    q, k, v = (mx.array(a).astype(dtype) for a in qkv(rng, 2, 16))
    i32 = lambda rows: mx.array(np.array(rows, dtype=np.int32))  # noqa: E731
    visible = mx.array(np.ones((2, 1, 1, 5), dtype=bool))
    paged = AttendGroups(i32([[0], [1]]), i32([[0], [2]]), visible, i32([0, 1]), k, v, page=4, tail=i32([[13], [14]]))
    cells = i32([[0, 1, 2, 3, 13], [8, 9, 10, 11, 14]])
    gathered = AttendGroups(i32([[0], [1]]), cells, visible, i32([0, 1]), k, v)
    got = attend_groups(q, paged, SCALE)
    assert got.dtype == dtype
    want = attend_groups(q, gathered, SCALE)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))


def test_grouped_attention_runs_on_any_thread_after_another_used_it(rng):
    # MLX's streams belong to their thread; the gather's second stream must be each thread's own
    # (a server steps its engine on a thread of its own, after the main thread attended).
    import concurrent.futures

    q, k, v = qkv(rng, 2, 6)
    cells = np.array([[0, 2, 4], [1, 3, 5]], dtype=np.int32)
    allowed = np.array([[0, 1, 0, 1, 0, 1], [1, 0, 1, 0, 1, 0]], dtype=bool)

    def grouped() -> np.ndarray:
        groups = AttendGroups(
            mx.array(np.array([[1], [0]], dtype=np.int32)), mx.array(cells), None,
            mx.array(np.array([1, 0], dtype=np.int32)), mx.array(k), mx.array(v),
        )
        return np.array(attend_groups(mx.array(q), groups, SCALE))

    here = grouped()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        there = pool.submit(grouped).result()
    np.testing.assert_allclose(here, reference(q, k, v, allowed), atol=1e-5)
    np.testing.assert_array_equal(there, here)


def test_attend_groups_over_is_what_attrs_evolve_makes():
    # `over` is the layer's step's shortcut for attrs.evolve(groups, keys=..., values=...): every field
    # the same object, the keys and values the layer's (attrs itself is the oracle).
    import attrs

    from kvlayout import AttendBatch, AttendGroups

    more = (AttendBatch(np.zeros((1, 1)), np.zeros((1, 2)), None, 4, np.ones((1, 1))),)
    groups = AttendGroups(np.zeros((2, 1)), np.ones((2, 3)), np.ones((2, 1, 1, 3), bool), np.arange(2),
                          more=more, page=8, tail=np.zeros((2, 1)), in_order=True)
    keys, values = object(), object()
    got, want = groups.over(keys, values), attrs.evolve(groups, keys=keys, values=values)
    for field in attrs.fields(AttendGroups):
        assert getattr(got, field.name) is getattr(want, field.name), field.name


def test_a_grouped_specs_fields_given_as_functions_are_made_once_when_read_and_attend_reads_none(rng):
    # A layout whose groups carry the work may give the dense keys, values and mask as functions: attend() reads
    # the groups' (against the hand-written reference), never those; a consumer that reads one makes it once.
    q, k, v = qkv(rng, 2, 5)
    made = []

    def lazily(name, value):
        def make():
            made.append(name)
            return mx.array(value)
        return make

    allowed = np.array([[1, 1, 0, 1, 0], [0, 0, 1, 1, 1]], dtype=bool)
    cells = [[0, 1, 3], [2, 3, 4]]  # each token's visible cells: one group each
    groups = AttendGroups(mx.array([[0], [1]], dtype=mx.int32), mx.array(cells, dtype=mx.int32), None,
                          mx.array([0, 1], dtype=mx.int32), mx.array(k), mx.array(v), in_order=True)
    spec = AttendSpec(lazily("keys", k), lazily("values", v), MaskKind.EXPLICIT, lazily("mask", allowed[None, None]),
                      groups, queries=2)
    np.testing.assert_allclose(np.array(attend(mx.array(q), spec, SCALE)), reference(q, k, v, allowed), atol=1e-5)
    assert made == []
    keys = spec.keys
    assert spec.keys is keys and np.array_equal(np.array(keys), k) and made == ["keys"]
    assert np.array_equal(np.array(spec.values), v) and np.array_equal(np.array(spec.mask)[0, 0], allowed)
    assert spec.values is spec.values and made == ["keys", "values", "mask"]
