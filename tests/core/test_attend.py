"""attend(): each MaskKind against a hand-written numpy softmax attention with GQA."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvlayout import AttendSpec, MaskKind
from kvlayout.mlx import attend

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
