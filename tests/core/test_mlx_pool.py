"""MLXPool: growth, scatter, storage casts, and refusals that leave the pool as it was.

Expectations come from numpy copies of the content, never from the pool itself.
Contents are compared bit for bit through a uint16/uint32 view.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvlayout import KVLayoutError
from kvlayout.mlx import Cells, MLXPool
from kvlayout.pool import Pool

H, D = 2, 3
BITS = {mx.float16: mx.uint16, mx.bfloat16: mx.uint16, mx.float32: mx.uint32}


def bits(a: mx.array) -> np.ndarray:
    """The raw bits of a float array, as numpy (numpy has no bfloat16)."""
    return np.array(a.view(BITS[a.dtype]))


def contents(pool: MLXPool) -> np.ndarray:
    return bits(pool.read(0, pool.slots))


def tokens(rng, n, heads=H, dim=D, dtype=mx.float32) -> mx.array:
    return mx.array(rng.normal(size=(1, heads, n, dim)).astype(np.float32)).astype(dtype)  # [1, H, n, D]


@pytest.fixture
def filled(rng):
    """A float16 pool of 8 slots (max 16), every slot holding random data; plus its numpy copy."""
    pool = MLXPool(8, 16, H, D, "float16")
    data = rng.normal(size=(1, H, 8, D)).astype(np.float16)
    pool.write(0, mx.array(data))
    return pool, data


def test_mlx_pool_is_a_pool():
    pool = MLXPool(4, 8, H, D)
    assert isinstance(pool, Pool)
    assert (pool.slots, pool.max_slots, pool.dtype) == (4, 8, mx.float16)
    assert pool.read(0, 4).shape == (1, H, 4, D)


def test_a_write_ending_at_5_grows_2_to_8_with_max_32(rng):
    pool = MLXPool(2, 32, H, D)
    pool.write(4, tokens(rng, 1))
    assert pool.slots == 8


def test_a_write_of_5_tokens_from_0_grows_2_to_8(rng):
    pool = MLXPool(2, 32, H, D)
    pool.write(0, tokens(rng, 5))
    assert pool.slots == 8


def test_growth_past_the_max_is_clamped_16_to_20(rng):
    pool = MLXPool(16, 20, H, D)
    pool.write(16, tokens(rng, 1))
    assert pool.slots == 20
    pool.write(19, tokens(rng, 1))  # the last slot is writable
    assert pool.slots == 20


def test_an_initial_size_above_the_max_is_clamped_512_to_4():
    pool = MLXPool(512, 4, H, D)
    assert pool.slots == 4 and pool.max_slots == 4
    assert pool.read(0, 4).shape == (1, H, 4, D)


def test_an_empty_pool_grows_on_its_first_write(rng):
    pool = MLXPool(0, 64, H, D)
    assert pool.slots == 0
    pool.write(0, tokens(rng, 1))
    assert pool.slots == 1  # doubling starts from max(slots, 1)
    pool.write(1, tokens(rng, 2))
    assert pool.slots == 4


def test_an_empty_pool_grows_on_its_first_scattered_write(rng):
    pool = MLXPool(0, 64, H, D)
    pool.write_cells([5], tokens(rng, 1))
    assert pool.slots == 8  # 1 -> 2 -> 4 -> 8 for cell 5


def test_an_empty_write_allocates_nothing(rng):
    pool = MLXPool(0, 64, H, D)
    pool.write(10, tokens(rng, 0))
    pool.write_cells([], tokens(rng, 0))
    assert pool.slots == 0


def test_growth_keeps_every_slot_where_it_was_and_zero_pads(filled, rng):
    pool, data = filled
    new = tokens(rng, 1, dtype=mx.float16)
    pool.write(12, new)
    assert pool.slots == 16
    expected = np.zeros((1, H, 16, D), dtype=np.float16)
    expected[:, :, :8] = data
    expected[:, :, 12:13] = np.array(new)
    assert np.array_equal(contents(pool), expected.view(np.uint16))


def test_write_stores_a_contiguous_run_and_keeps_the_rest_byte_identical(filled, rng):
    pool, data = filled
    new = tokens(rng, 3, dtype=mx.float16)
    pool.write(2, new)
    expected = data.copy()
    expected[:, :, 2:5] = np.array(new)
    assert np.array_equal(contents(pool), expected.view(np.uint16))


@pytest.mark.parametrize("as_type", [list, np.array, lambda c: mx.array(c, dtype=mx.int32), Cells],
                         ids=["list", "numpy", "mlx", "Cells"])
def test_write_cells_scatters_token_i_into_cell_i_and_keeps_the_rest_byte_identical(filled, rng, as_type):
    pool, data = filled
    cells = [6, 1, 4]  # deliberately unsorted: token 0 goes to cell 6
    new = tokens(rng, 3, dtype=mx.float16)
    pool.write_cells(as_type(cells), new)
    expected = data.copy()
    expected[:, :, cells] = np.array(new)
    assert np.array_equal(contents(pool), expected.view(np.uint16))
    assert np.array_equal(bits(pool.read(6, 1)), np.array(new)[:, :, 0:1].view(np.uint16))


def test_write_cells_past_the_allocated_slots_grows_and_keeps_the_rest(filled, rng):
    pool, data = filled
    new = tokens(rng, 2, dtype=mx.float16)
    pool.write_cells([13, 0], new)
    assert pool.slots == 16
    expected = np.zeros((1, H, 16, D), dtype=np.float16)
    expected[:, :, :8] = data
    expected[:, :, [13, 0]] = np.array(new)
    assert np.array_equal(contents(pool), expected.view(np.uint16))


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
@pytest.mark.parametrize("scatter", [False, True], ids=["write", "write_cells"])
def test_float32_updates_are_cast_to_the_storage_dtype(rng, storage, scatter):
    pool = MLXPool(4, 4, H, D, storage)
    update = tokens(rng, 4) * 1000.0 + 0.3333  # not representable in 16 bits
    if scatter:
        pool.write_cells([3, 2, 1, 0], update)
        update = update[:, :, ::-1]
    else:
        pool.write(0, update)
    stored = pool.read(0, 4)
    assert stored.dtype == pool.dtype == getattr(mx, storage)
    assert np.array_equal(bits(stored), bits(update.astype(getattr(mx, storage))))
    if storage == "float16":  # and independently of MLX's cast
        assert np.array_equal(np.array(stored), np.array(update).astype(np.float16))


def test_a_bfloat16_update_into_a_float32_pool_is_widened_exactly(rng):
    pool = MLXPool(2, 2, H, D, "float32")
    update = tokens(rng, 2, dtype=mx.bfloat16)
    pool.write(0, update)
    assert pool.read(0, 2).dtype == mx.float32
    assert np.array_equal(np.array(pool.read(0, 2)), np.array(update.astype(mx.float32)))


def test_the_storage_dtype_may_be_given_as_an_mlx_dtype():
    assert MLXPool(1, 1, H, D, mx.bfloat16).dtype == mx.bfloat16


# Each refused call, against the `filled` pool (8 slots of 16, H=2, D=3).
REFUSED = [
    pytest.param(lambda p, r: p.write(0, tokens(r, 1, heads=3)), id="write-wrong-heads"),
    pytest.param(lambda p, r: p.write(0, tokens(r, 1, dim=4)), id="write-wrong-dim"),
    pytest.param(lambda p, r: p.write(0, tokens(r, 1)[0]), id="write-3d"),
    pytest.param(lambda p, r: p.write(0, mx.concatenate([tokens(r, 1)] * 2, axis=0)), id="write-batch-2"),
    pytest.param(lambda p, r: p.write(0, mx.ones((1, H, 1, D), dtype=mx.int32)), id="write-int-dtype"),
    pytest.param(lambda p, r: p.write(0, np.ones((1, H, 1, D), dtype=np.float16)), id="write-numpy"),
    pytest.param(lambda p, r: p.write(0, [[[[1.0] * D]] * H]), id="write-list"),
    pytest.param(lambda p, r: p.write(14, tokens(r, 3)), id="write-past-max"),
    pytest.param(lambda p, r: p.write(16, tokens(r, 1)), id="write-at-max"),
    pytest.param(lambda p, r: p.write(-1, tokens(r, 1)), id="write-negative-start"),
    pytest.param(lambda p, r: p.write(1.0, tokens(r, 1)), id="write-float-start"),
    pytest.param(lambda p, r: p.write(True, tokens(r, 1)), id="write-bool-start"),
    pytest.param(lambda p, r: p.write_cells([1, 9], tokens(r, 2, heads=1)), id="cells-wrong-heads"),
    pytest.param(lambda p, r: p.write_cells([1, 9], tokens(r, 2, dim=2)), id="cells-wrong-dim"),
    pytest.param(lambda p, r: p.write_cells([1], tokens(r, 1)[0]), id="cells-3d"),
    pytest.param(lambda p, r: p.write_cells([1], mx.ones((1, H, 1, D), dtype=mx.int16)), id="cells-int-dtype"),
    pytest.param(lambda p, r: p.write_cells([1], np.ones((1, H, 1, D), dtype=np.float32)), id="cells-numpy"),
    pytest.param(lambda p, r: p.write_cells([3, 9, 3], tokens(r, 3)), id="cells-repeated"),
    pytest.param(lambda p, r: p.write_cells([1, 9], tokens(r, 3)), id="cells-too-few"),
    pytest.param(lambda p, r: p.write_cells([1, 9, 2], tokens(r, 2)), id="cells-too-many"),
    pytest.param(lambda p, r: p.write_cells([1, 16], tokens(r, 2)), id="cells-past-max"),
    pytest.param(lambda p, r: p.write_cells([-1, 9], tokens(r, 2)), id="cells-negative"),
    pytest.param(lambda p, r: p.write_cells([0.0, 9.0], tokens(r, 2)), id="cells-float"),
    pytest.param(lambda p, r: p.write_cells([[1, 9]], tokens(r, 2)), id="cells-2d"),
    # Checked once (Cells): repeats and negatives refused as it is made, the rest where it is written.
    pytest.param(lambda p, r: p.write_cells(Cells([3, 9, 3]), tokens(r, 3)), id="Cells-repeated"),
    pytest.param(lambda p, r: p.write_cells(Cells([-1, 9]), tokens(r, 2)), id="Cells-negative"),
    pytest.param(lambda p, r: p.write_cells(Cells([1, 16]), tokens(r, 2)), id="Cells-past-max"),
    pytest.param(lambda p, r: p.write_cells(Cells([1, 9]), tokens(r, 3)), id="Cells-too-few"),
    pytest.param(lambda p, r: p.write_cells(Cells([1, 9]), tokens(r, 2, heads=1)), id="Cells-wrong-heads"),
]


@pytest.mark.parametrize("call", REFUSED)
def test_a_refused_write_raises_and_leaves_slots_and_content_unchanged(filled, rng, call):
    pool, data = filled
    before = contents(pool)
    with pytest.raises(KVLayoutError):
        call(pool, rng)
    assert pool.slots == 8
    assert pool.dtype == mx.float16
    assert np.array_equal(contents(pool), before)
    assert np.array_equal(before, data.view(np.uint16))


@pytest.mark.parametrize("start, length", [(6, 3), (8, 1), (-1, 2), (0, -1), (0, 9)])
def test_a_read_outside_the_allocated_slots_is_refused(filled, start, length):
    pool, _ = filled
    with pytest.raises(KVLayoutError):
        pool.read(start, length)
    assert pool.slots == 8


def test_a_read_up_to_the_allocated_slots_is_allowed(filled):
    pool, data = filled
    assert np.array_equal(np.array(pool.read(5, 3)), data[:, :, 5:8])
    assert pool.read(8, 0).shape == (1, H, 0, D)


@pytest.mark.parametrize(
    "args",
    [(4, 0, H, D), (4, 8, 0, D), (4, 8, H, 0), (-1, 8, H, D), (4, 8, H, D, "int8"), (4, 8, H, D, "fp16")],
)
def test_a_pool_of_impossible_shape_or_dtype_is_refused(args):
    with pytest.raises(KVLayoutError):
        MLXPool(*args)


def test_evaluate_finishes_pending_writes_and_the_next_write_stays_in_place():
    n = 1 << 20
    pool = MLXPool(n, n, 1, 16, "float32")  # 64 MiB: a copy of it would show in the peak
    pool.evaluate()
    token = mx.ones((1, 1, 1, 16))
    mx.eval(token)
    pool.write(5, token)
    pool.evaluate()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    pool.write(6, token)
    pool.evaluate()
    assert mx.get_peak_memory() - before < pool.nbytes // 2
    assert np.array_equal(np.array(pool.read(5, 2)), np.ones((1, 1, 2, 16), dtype=np.float32))


@pytest.mark.parametrize("scatter", [False, True], ids=["write", "write_cells"])
def test_a_read_taken_before_a_write_keeps_what_it_read(filled, rng, scatter):
    # MLX arrays are values: a write goes in place only when nothing else holds the buffer, and
    # must never change a view someone kept (the numpy copy is the oracle).
    pool, data = filled
    kept = pool.read(0, 8)
    new = tokens(rng, 2, dtype=mx.float16)
    pool.write_cells([5, 2], new) if scatter else pool.write(2, new)
    assert np.array_equal(bits(kept), data.view(np.uint16))
    expected = data.copy()
    expected[:, :, [5, 2] if scatter else [2, 3]] = np.array(new)
    assert np.array_equal(contents(pool), expected.view(np.uint16))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_layout_s_unchecked_runs_store_and_read_what_the_checked_verbs_do(rng, dtype):
    # write_run / read_run skip the pool's checks (the layout made them): same bits, same growth by doubling
    checked, lean = MLXPool(2, 16, H, D, dtype), MLXPool(2, 16, H, D, dtype)
    for start, n in [(0, 1), (1, 2), (3, 4), (9, 1)]:  # past 2, 4 and 8 slots: each grows the pool
        update = tokens(rng, n)
        checked.write(start, update)
        lean.write_run(start, update)
        assert lean.slots == checked.slots
        assert np.array_equal(bits(lean.read_run(0, start + n)), bits(checked.read(0, start + n)))
    assert checked.slots == lean.slots == 16 and np.array_equal(contents(lean), contents(checked))
    cells = Cells([14, 3, 9], distinct=True)  # a placement's cells, scattered
    update = tokens(rng, 3)
    checked.write_cells(cells, update)
    lean.write_placed(cells, update)
    assert np.array_equal(contents(lean), contents(checked))
    grown_checked, grown_lean = MLXPool(2, 16, H, D, dtype), MLXPool(2, 16, H, D, dtype)
    grown_checked.write_cells(cells, update)
    grown_lean.write_placed(cells, update)  # past the 2 slots it has: it grows to 16, as write_cells does
    assert grown_lean.slots == grown_checked.slots == 16 and np.array_equal(contents(grown_lean),
                                                                            contents(grown_checked))


def test_a_pool_without_unchecked_runs_takes_them_through_its_checked_verbs(rng):
    from kvlayout.mlx.quantized import QuantizedPool

    checked, lean = QuantizedPool(4, 16, H, 64, 8, 64), QuantizedPool(4, 16, H, 64, 8, 64)
    update = tokens(rng, 3, dim=64)
    checked.write(2, update)
    lean.write_run(2, update)
    with pytest.raises(KVLayoutError, match="past max_slots"):
        lean.write_run(15, update)  # the default write_run is write: still checked
    assert all(np.array_equal(np.array(a), np.array(b))
               for a, b in zip(lean.read_run(2, 3).parts(), checked.read(2, 3).parts()))
