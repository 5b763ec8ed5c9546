"""Every refused call raises a kvlayout error naming the numbers and changes nothing."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvlayout import CapacityError, KVLayoutError, StepError
from tests.seq.support import D, H, assert_same, kv, one, snapshot, tokens, wrapped_cache


@pytest.fixture
def cache():
    return wrapped_cache()


REFUSALS = {
    "gap after the length": (0, [11], one(), one(), StepError, r"start at 11.*holds 10"),
    "older than the ring holds": (1, [7], one(), one(), StepError, r"start at 7.*\[8, 10\]"),
    "older than the ring holds, on a flat layer too": (0, [7], one(), one(), StepError, r"\[8, 10\]"),
    "past capacity": (0, [10, 11, 12], one(3), one(3), CapacityError, r"ends at 13.*capacity=12"),
    "ring step longer than max_write": (1, [8, 9, 10], one(3), one(3), StepError, r"3 token.*max_write=2"),
    "too long for the ring, at the flat layer": (0, [8, 9, 10], one(3), one(3), StepError, "max_write=2"),
    "positions not consecutive": (0, [9, 11], one(2), one(2), StepError, r"\[9, 11\].*consecutive"),
    "positions descending": (0, [10, 9], one(2), one(2), StepError, r"consecutive"),
    "float in a list": (0, [10.0], one(), one(), StepError, r"positions.*10\.0"),
    "bool in a list": (0, [True], one(), one(), StepError, r"positions.*True"),
    "numpy floats": (0, np.array([10.0]), one(), one(), StepError, r"positions.*float64"),
    "numpy NaN": (0, np.array([np.nan]), one(), one(), StepError, r"positions.*float"),
    "numpy bools": (0, np.array([True]), one(), one(), StepError, r"positions.*bool"),
    "mlx floats": (0, mx.array([10.0]), one(), one(), StepError, r"positions.*float32"),
    "2-d positions": (0, np.array([[10]]), one(), one(), StepError, r"positions.*\(1, 1\)"),
    "a string for positions": (0, "10", one(), one(), StepError, r"positions.*str"),
    "negative positions": (0, [-1], one(), one(), StepError, r"start at -1.*>= 0"),
    "a position past 64 bits": (0, [2**70], one(), one(), StepError, r"positions.*64 bits"),
    "mlx bools": (0, mx.array([True]), one(), one(), StepError, r"positions.*bool"),
    "layer out of range": (2, [10], one(), one(), StepError, r"layer=2.*\[0, 1\]"),
    "negative layer": (-1, [10], one(), one(), StepError, r"layer=-1"),
    "bool layer": (True, [10], one(), one(), StepError, r"layer=True"),
    "wrong head count": (0, [10], one(heads=3), one(heads=3), StepError, r"\(1, 3, 1, 4\).*\[1, 2, T, 4\]"),
    "v head_dim differs": (0, [10], one(), one(dim=5), StepError, r"v of shape \(1, 2, 1, 5\).*\[1, 2, T, 4\]"),
    "token count differs from positions": (0, [10], one(2), one(2), StepError, r"1 position\(s\) for k/v of 2 token"),
    "integer values": (0, [10], one(), one().astype(mx.int32), StepError, r"v of dtype .*int32: expected a floating"),
    "numpy keys": (
        0, [10], np.zeros((1, H, 1, D), np.float32), one(), StepError, r"k of .*\(ndarray\): expected an mlx"
    ),
    "empty step": (0, [], one(0), one(0), StepError, r"0 token"),
}


@pytest.mark.parametrize("case", REFUSALS, ids=list(REFUSALS))
def test_a_refused_step_raises_naming_the_numbers_and_changes_nothing(cache, case):
    layer, positions, k, v, error, message = REFUSALS[case]
    before = snapshot(cache)
    with pytest.raises(error, match=message):
        cache.update_and_fetch(layer, positions, k, v)
    assert_same(snapshot(cache), before)


def test_a_refused_step_leaves_the_cache_ready_for_the_corrected_one(cache):
    with pytest.raises(StepError):
        cache.update_and_fetch(1, [8, 9, 10], one(3), one(3))
    k, v = one(), one(seed=10)
    spec = cache.update_and_fetch(1, [10], k, v)
    fed, _ = kv(10)  # what the fixture fed
    # The ring's window for token 10 is 7..9, then the token itself.
    want = np.concatenate([tokens(fed, [7, 8, 9]), np.array(k)], axis=2)
    np.testing.assert_array_equal(np.array(spec.keys), want)


@pytest.mark.parametrize("new_len", [11, 7, 1])
def test_a_refused_rewind_answers_false_and_changes_nothing(cache, new_len):
    before = snapshot(cache)
    assert cache.as_control().rewind(new_len) is False
    assert_same(snapshot(cache), before)


def test_a_wrapped_cache_rewinds_to_empty_and_starts_again_at_zero(cache):
    # nothing below 8 can be rewound to, but length 0 needs no position a ring lost
    assert cache.as_control().rewind(0) and cache.as_control().length == 0
    k, v = kv(2)
    spec = cache.update_and_fetch(1, [0, 1], k, v)  # the ring layer: just the two new tokens
    np.testing.assert_array_equal(np.array(spec.keys), np.array(k))


@pytest.mark.parametrize("bad", [-1, 8.0, True, None])
def test_a_rewind_to_a_non_count_raises_naming_it_and_changes_nothing(cache, bad):
    before = snapshot(cache)
    with pytest.raises(KVLayoutError, match="new_len"):
        cache.as_control().rewind(bad)
    assert_same(snapshot(cache), before)


@pytest.mark.parametrize("bad", [-1, 1.5, False])
def test_can_extend_of_a_non_count_raises_naming_it(cache, bad):
    with pytest.raises(KVLayoutError, match="n="):
        cache.as_control().can_extend(bad)


def test_can_extend_answers_false_at_capacity_without_raising(cache):
    assert cache.as_control().can_extend(2) and not cache.as_control().can_extend(3)
