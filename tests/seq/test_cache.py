"""The MLX face: every case the issue lists, checked against the tokens fed in."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvlayout import CacheConfig, CapacityError, ConfigError, MaskKind, StepError
from kvlayout_seq.mlx_cache import SeqCache
from tests.seq.support import forward, kv, layer, make_cache, rows, step, tokens


def test_prefill_of_4_is_causal_and_returns_the_input():
    cache = make_cache()
    k, v = kv(4)
    spec = step(cache, 0, k, v)
    assert spec.mask_kind is MaskKind.CAUSAL and spec.mask is None
    np.testing.assert_array_equal(np.array(spec.keys), np.array(k))
    np.testing.assert_array_equal(np.array(spec.values), np.array(v))
    assert cache.as_control().length == 4


def test_a_decode_after_prefill_needs_no_mask_and_sees_the_concatenation():
    cache = make_cache()
    k, v = kv(5)
    step(cache, 0, k[:, :, :4], v[:, :, :4])
    spec = step(cache, 4, k[:, :, 4:], v[:, :, 4:])
    assert spec.mask_kind is MaskKind.NONE
    np.testing.assert_array_equal(np.array(spec.keys), np.array(k))
    np.testing.assert_array_equal(np.array(spec.values), np.array(v))


def test_position_32_in_a_capacity_32_cache_raises():
    cache = make_cache(capacity=32)
    k, v = kv(33)
    step(cache, 0, k[:, :, :32], v[:, :, :32])
    assert not cache.as_control().can_extend()
    with pytest.raises(CapacityError, match="32"):
        step(cache, 32, k[:, :, 32:], v[:, :, 32:])
    assert cache.as_control().length == 32


def test_fp32_into_fp16_storage_equals_a_plain_cast():
    cache = make_cache(kv_dtype="float16")
    k, v = kv(3)
    spec = step(cache, 0, k, v)
    assert spec.keys.dtype == mx.float16
    np.testing.assert_array_equal(np.array(spec.keys), np.array(k.astype(mx.float16)))
    np.testing.assert_array_equal(np.array(spec.values), np.array(v.astype(mx.float16)))


def test_a_partial_layer_list_is_a_config_error():
    two = [layer().to_mapping()] * 2
    with pytest.raises(ConfigError, match="n_layers=3"):
        SeqCache({"capacity": 32, "n_layers": 3, "layers": two})


def test_growth_from_initial_2_preserves_earlier_cells():
    cache = make_cache(initial_capacity=2)
    assert cache.key_pools[0].slots == 2
    k, v = kv(5)
    step(cache, 0, k[:, :, :2], v[:, :, :2])
    assert cache.key_pools[0].slots == 2
    spec = step(cache, 2, k[:, :, 2:], v[:, :, 2:])
    assert cache.key_pools[0].slots == 8  # doubled twice: 2 -> 4 -> 8
    np.testing.assert_array_equal(np.array(spec.keys), np.array(k))
    np.testing.assert_array_equal(np.array(spec.values), np.array(v))


def test_initial_0_grows_on_the_first_write():
    cache = make_cache(initial_capacity=0)
    assert cache.key_pools[0].slots == 0
    k, v = kv(1)
    spec = step(cache, 0, k, v)
    assert cache.key_pools[0].slots == 1
    np.testing.assert_array_equal(np.array(spec.keys), np.array(k))


def test_flat_pools_start_at_the_capacity_when_it_is_below_initial_capacity():
    cache = make_cache(capacity=32, initial_capacity=512)
    assert cache.key_pools[0].slots == cache.value_pools[0].slots == 32


def test_ring_pools_are_allocated_whole_before_any_write():
    cache = make_cache(windows=(4,), max_write=2, initial_capacity=0)
    assert cache.key_pools[0].slots == cache.value_pools[0].slots == 10  # 4 + 2 - 1 slots, and their mirror


def test_a_ring_that_never_wraps_is_not_mirrored():
    cache = make_cache(windows=(4,), capacity=6)  # 7 slots would exceed every position: 6, no wrap
    assert cache.key_pools[0].slots == 6


def test_a_wrapped_ring_window_is_a_view_of_the_pool_not_a_copy():
    # ring(4), max_write=1: 4 slots; after 6 tokens the window 2..5 sits in slots 2, 3, 0, 1,
    # read in order from the mirror as slots 2..5 of the doubled pool
    cache = make_cache(windows=(4,), max_write=1)
    fed = [kv(1, seed=i) for i in range(6)]
    for p, (k, v) in enumerate(fed):
        spec = cache.update_and_fetch(0, [p], k, v)
    pool = np.array(cache.key_pools[0].read(0, 8))
    np.testing.assert_array_equal(pool[:, :, :4], pool[:, :, 4:])  # the mirror repeats the ring
    want = np.concatenate([np.array(k) for k, _ in fed[2:]], axis=2)
    np.testing.assert_array_equal(np.array(spec.keys), want)
    np.testing.assert_array_equal(pool[:, :, 2:6], want)


def test_ring_w4_max_write_1_after_six_tokens_sees_tokens_2_to_5_in_order():
    cache = make_cache(windows=(4,), max_write=1)
    k, v = kv(6)
    for t in range(6):
        spec = step(cache, t, k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert spec.mask_kind is MaskKind.NONE
    np.testing.assert_array_equal(np.array(spec.keys), tokens(k, [2, 3, 4, 5]))
    np.testing.assert_array_equal(np.array(spec.values), tokens(v, [2, 3, 4, 5]))


def test_ring_w4_max_write_2_pair_at_0_is_causal():
    cache = make_cache(windows=(4,), max_write=2)
    k, v = kv(2)
    spec = step(cache, 0, k, v)
    assert spec.mask_kind is MaskKind.CAUSAL
    np.testing.assert_array_equal(np.array(spec.keys), np.array(k))


def test_ring_w4_max_write_2_four_singles_then_a_pair_is_a_band_over_tokens_1_to_5():
    cache = make_cache(windows=(4,), max_write=2)
    k, v = kv(6)
    for t in range(4):
        step(cache, t, k[:, :, t : t + 1], v[:, :, t : t + 1])
    spec = step(cache, 4, k[:, :, 4:], v[:, :, 4:])
    assert spec.mask_kind is MaskKind.EXPLICIT
    assert spec.mask.shape == (1, 1, 2, 5) and spec.mask.dtype == mx.bool_
    assert rows(spec.mask) == ["11110", "01111"]
    np.testing.assert_array_equal(np.array(spec.keys), tokens(k, [1, 2, 3, 4, 5]))
    np.testing.assert_array_equal(np.array(spec.values), tokens(v, [1, 2, 3, 4, 5]))


def test_a_ring_step_of_5_with_window_4_is_refused():
    cache = make_cache(windows=(4,))
    k, v = kv(5)
    with pytest.raises(StepError, match="5 token.*max_write=4"):
        step(cache, 0, k, v)
    assert cache.as_control().length == 0


def test_after_rewind_3_a_new_token_attends_exactly_the_kept_three_and_itself():
    cache = make_cache()
    k, v = kv(5)
    step(cache, 0, k, v)
    assert cache.as_control().rewind(3)
    k2, v2 = kv(1, seed=1)
    spec = step(cache, 3, k2, v2)
    assert spec.mask_kind is MaskKind.NONE
    want_k = np.concatenate([tokens(k, [0, 1, 2]), np.array(k2)], axis=2)
    want_v = np.concatenate([tokens(v, [0, 1, 2]), np.array(v2)], axis=2)
    np.testing.assert_array_equal(np.array(spec.keys), want_k)
    np.testing.assert_array_equal(np.array(spec.values), want_v)
    assert cache.as_control().length == 4


def test_flat_plus_ring4_at_length_10_rewinds_to_6_but_not_5_or_11():
    cache = make_cache(windows=(0, 4))
    k, v = kv(10)
    forward(cache, 0, k, v, chunk=4)
    assert cache.as_control().length == 10
    assert not cache.as_control().rewind(5)
    assert not cache.as_control().rewind(11)
    assert cache.as_control().rewind(6)
    assert cache.as_control().length == 6


def test_after_a_ring_rewind_the_next_token_sees_the_window_it_would_have_seen():
    # ring w=4, max_write=1 at length 10: rewind(9), then a new token 9 sees 6, 7, 8 and itself.
    cache = make_cache(windows=(4,), max_write=1)
    k, v = kv(10)
    for t in range(10):
        step(cache, t, k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert not cache.as_control().rewind(8)
    assert cache.as_control().rewind(9)
    k2, v2 = kv(1, seed=2)
    spec = step(cache, 9, k2, v2)
    want = np.concatenate([tokens(k, [6, 7, 8]), np.array(k2)], axis=2)
    np.testing.assert_array_equal(np.array(spec.keys), want)


def test_every_layer_of_one_forward_writes_the_same_positions():
    cache = make_cache(windows=(0, 4, 0))
    k, v = kv(3)
    for i in range(3):
        spec = step(cache, 0, k, v, i)
        assert cache.as_control().length == 3
        np.testing.assert_array_equal(np.array(spec.keys), np.array(k))


def test_a_step_below_the_length_overwrites_and_truncates_to_its_end():
    cache = make_cache()
    k, v = kv(6)
    step(cache, 0, k, v)
    k2, v2 = kv(1, seed=3)
    spec = step(cache, 2, k2, v2)
    assert cache.as_control().length == 3
    want = np.concatenate([tokens(k, [0, 1]), np.array(k2)], axis=2)
    np.testing.assert_array_equal(np.array(spec.keys), want)


@pytest.mark.parametrize(
    "positions",
    [[4, 5], (4, 5), range(4, 6), np.array([4, 5], dtype=np.int32), mx.array([4, 5], dtype=mx.int32)],
    ids=["list", "tuple", "range", "numpy", "mlx"],
)
def test_positions_may_be_a_list_a_numpy_array_or_an_mlx_array(positions):
    cache = make_cache()
    k, v = kv(6)
    step(cache, 0, k[:, :, :4], v[:, :, :4])
    spec = cache.update_and_fetch(0, positions, k[:, :, 4:], v[:, :, 4:])
    np.testing.assert_array_equal(np.array(spec.keys), np.array(k))


def test_clear_starts_a_new_sequence_at_zero():
    cache = make_cache(windows=(0, 4), max_write=1)
    k, v = kv(6)
    forward(cache, 0, k, v, chunk=1)
    cache.as_control().clear()
    assert cache.as_control().length == 0 and cache.as_control().can_extend(32)
    k2, v2 = kv(1, seed=4)
    for spec in forward(cache, 0, k2, v2):
        np.testing.assert_array_equal(np.array(spec.keys), np.array(k2))


def test_the_cache_offers_a_sequence_control_face_with_its_contracts_verbs_only():
    from kvlayout.faces import KVCache, SequenceControl

    cache = make_cache()
    control = cache.as_control()
    assert control is cache.as_control()  # one face object per cache
    assert isinstance(control, SequenceControl) and isinstance(cache, KVCache)
    assert sorted(n for n in dir(control) if not n.startswith("_")) == [
        "can_extend", "capacity", "clear", "length", "max_step", "rewind"]
    assert cache.as_batch_control() is None and cache.as_cell_stepper() is None
    assert control.capacity == 32
    forward(cache, 0, *kv(3))
    assert control.length == 3 and control.rewind(1) and cache.as_control().length == 1


def test_heads_and_head_dim_follow_each_layers_config():
    cache = SeqCache(CacheConfig(capacity=8, n_layers=2, layers=[layer(0, 2, 4), layer(3, 1, 6)]))
    spec = cache.update_and_fetch(1, [0], mx.zeros((1, 1, 1, 6)), mx.zeros((1, 1, 1, 6)))
    assert spec.keys.shape == (1, 1, 1, 6)
