"""Any schedule of steps and rewinds: each step attends exactly what its positions should see.

The oracle is a plain list of the tokens of the current sequence: a step at
`s` replaces everything from `s` on, and query position p sees key position
q iff `q <= p` and, on a ring layer of window w, `q > p - w`. Nothing of the
cache's slot arithmetic is reused.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings, strategies as st

from kvlayout import MaskKind

from tests.seq.support import make_cache

WINDOWS = (0, 3, 5)
CAPACITY = 24
H, D = 2, 4


def effective_mask(spec, T: int, S: int) -> np.ndarray:
    """The bool [T, S] mask attention will apply for this spec."""
    if spec.mask_kind is MaskKind.NONE:
        return np.ones((T, S), bool)
    if spec.mask_kind is MaskKind.CAUSAL:  # lower-right aligned, as MLX applies it
        return np.arange(S)[None, :] <= np.arange(T)[:, None] + S - T
    return np.array(spec.mask).reshape(T, S)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(1, 4)),  # T new tokens at the length
        st.tuples(st.just("redo"), st.integers(1, 3), st.integers(1, 4)),  # back b, then T tokens
        st.tuples(st.just("rewind"), st.integers(0, 6)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(max_write=st.integers(1, 4), schedule=ops, seed=st.integers(0, 2**16))
def test_every_step_sees_exactly_the_keys_its_positions_allow(max_write, schedule, seed):
    cache = make_cache(windows=WINDOWS, capacity=CAPACITY, max_write=max_write, initial_capacity=2)
    rng = np.random.default_rng(seed)
    seq: list[np.ndarray] = []  # the oracle: token i's K for every kept position i, [1, H, 1, D] each
    for op in schedule:
        if op[0] == "rewind":
            new_len = max(0, len(seq) - op[1])
            if cache.rewind(new_len):
                del seq[new_len:]
            assert cache.length == len(seq)
            continue
        start = len(seq) if op[0] == "step" else max(0, len(seq) - op[1])
        T = min(op[-1], max_write)
        if start + T > CAPACITY or start < cache.book.floor:
            continue  # refusals are tested on their own
        k = rng.normal(size=(1, H, T, D)).astype(np.float32)
        del seq[start:]
        seq.extend(k[:, :, i : i + 1] for i in range(T))
        for layer, w in enumerate(WINDOWS):
            spec = cache.update_and_fetch(layer, range(start, start + T), mx.array(k), mx.array(k))
            first = 0 if w == 0 else max(0, start - w + 1)
            want = np.concatenate(seq[first:], axis=2)  # keys q in [first, start + T)
            np.testing.assert_array_equal(np.array(spec.keys), want)
            np.testing.assert_array_equal(np.array(spec.values), want)
            p = np.arange(start, start + T)[:, None]
            q = np.arange(first, start + T)[None, :]
            allowed = (q <= p) & ((q > p - w) if w else True)
            np.testing.assert_array_equal(effective_mask(spec, T, want.shape[2]), allowed)
        assert cache.length == len(seq)
