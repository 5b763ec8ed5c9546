"""Quantized K/V ("q8"/"q4"): a numpy oracle for the triples, attend() against it, QuantizedPool,
the config's refusals and the byte counts.

The oracle (`dequantize`) unpacks the uint32 words and applies scale and bias itself; it never
calls `mx.dequantize`, and its own tests check it against words packed by hand. Attention is
checked against a float64 numpy softmax over the oracle's keys and values, never against
another MLX path only. Pool contents are compared bit for bit (scales and biases as uint16).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvlayout
from kvlayout import (
    AttendBatch,
    AttendGroups,
    AttendSpec,
    CacheConfig,
    ConfigError,
    KVLayoutError,
    LayerConfig,
    MaskKind,
)
from kvlayout.mlx import QuantizedPool, attend, cell_bytes, kv_pool, pool_bytes, slot_bytes
from kvlayout.mlx.pool import MLXPool
from kvlayout.spec import QuantizedKV

# -- the oracle ------------------------------------------------------------------------------------


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint32 words `[..., W]` as their `bits`-bit integers `[..., W * 32 / bits]`, little end first:
    element j of word w is `(w >> (bits * j)) & (2**bits - 1)`."""
    words = np.asarray(packed, dtype=np.uint32)
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * np.uint32(bits))
    ints = (words[..., None] >> shifts) & np.uint32(2**bits - 1)  # [..., W, per]
    return ints.reshape(*words.shape[:-1], words.shape[-1] * per).astype(np.int64)


def dequantize(packed, scales, biases, bits: int, group_size: int) -> np.ndarray:
    """The float64 values of a triple: `scale * int + bias`, one scale and bias per group of
    `group_size` consecutive elements of a row."""
    ints = unpack(np.asarray(packed), bits)  # [..., D]
    *lead, d = ints.shape
    groups = ints.reshape(*lead, d // group_size, group_size).astype(np.float64)
    s = np.asarray(scales, dtype=np.float64)[..., None]
    b = np.asarray(biases, dtype=np.float64)[..., None]
    return (s * groups + b).reshape(*lead, d)


def oracle(x: QuantizedKV) -> np.ndarray:
    return dequantize(np.array(x.packed), np.array(x.scales), np.array(x.biases), x.bits, x.group_size)


def bits_of(x: QuantizedKV) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A triple's parts as exact bits: packed words, and scales/biases as uint16."""
    return np.array(x.packed), np.array(x.scales).view(np.uint16), np.array(x.biases).view(np.uint16)


def same_bits(a: QuantizedKV, b: QuantizedKV) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(bits_of(a), bits_of(b), strict=True))


def test_the_oracle_unpacks_4_bit_words_little_end_first():
    words = np.array([0x76543210, 0xFEDCBA98, 0x00000000, 0xFFFFFFFF], dtype=np.uint32)
    assert unpack(words, 4).tolist() == list(range(16)) + [0] * 8 + [15] * 8


def test_the_oracle_unpacks_8_bit_words_little_end_first():
    words = np.array([[0x04030201, 0xFF00807F]], dtype=np.uint32)
    assert unpack(words, 8).tolist() == [[1, 2, 3, 4, 0x7F, 0x80, 0x00, 0xFF]]


def test_the_oracle_applies_each_groups_scale_and_bias():
    # D = 64 at 4 bits: 8 words; groups of 32 take words 0-3 and 4-7.
    words = np.array([0x76543210, 0xFEDCBA98, 0, 0xFFFFFFFF, 0x11111111, 0x22222222, 0x33333333, 0x44444444],
                     dtype=np.uint32)
    scales = np.array([0.5, 2.0], dtype=np.float16)
    biases = np.array([-1.0, 0.25], dtype=np.float16)
    got = dequantize(words, scales, biases, bits=4, group_size=32)
    ints0 = list(range(16)) + [0] * 8 + [15] * 8
    ints1 = [1] * 8 + [2] * 8 + [3] * 8 + [4] * 8
    want = [0.5 * i - 1.0 for i in ints0] + [2.0 * i + 0.25 for i in ints1]
    np.testing.assert_array_equal(got, want)


def within_a_step(got: np.ndarray, x: np.ndarray, scales: np.ndarray, group: int) -> None:
    """`got` is `x` quantized: off by at most one step (MLX fits a group's scale so that its
    larger edge lands on the grid, which may push the other edge up to a step away), by about a
    quarter of a step on average, and not exactly `x`."""
    step = np.repeat(np.abs(np.asarray(scales, dtype=np.float64)), group, axis=-1)
    err = np.abs(got - np.asarray(x, dtype=np.float64))
    assert (err <= step + 1e-3).all(), err.max()
    assert (err / step).mean() < 0.35 and err.max() > 0


def test_the_oracle_of_mx_quantize_is_within_a_step_of_the_input(rng):
    for bits, group in ((8, 32), (4, 64), (4, 32), (8, 128)):
        x = rng.normal(size=(3, 5, 128)).astype(np.float16)
        packed, scales, biases = mx.quantize(mx.array(x), group_size=group, bits=bits)
        got = dequantize(np.array(packed), np.array(scales), np.array(biases), bits, group)
        within_a_step(got, x, np.array(scales), group)


# -- attend() over quantized keys and values ---------------------------------------------------


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray, scale: float) -> np.ndarray:
    """float64 softmax(q k^T * scale, masked) v over `[B, H, S, D]` keys; query head h reads
    kv head h // (H_q / H_kv)."""
    b, hq, t, _ = q.shape
    rep = hq // k.shape[1]
    out = np.zeros(q.shape, dtype=np.float64)
    for n in range(b):
        for h in range(hq):
            scores = q[n, h].astype(np.float64) @ k[n, h // rep].T * scale  # [T, S]
            scores = np.where(allowed[n] if allowed.ndim == 3 else allowed, scores, -np.inf)
            w = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[n, h] = (w / w.sum(axis=-1, keepdims=True)) @ v[n, h // rep]
    return out


def filled_pools(rng, h_kv, s, d, bits, group, slots=None):
    """A K and a V QuantizedPool holding `s` random tokens from slot 0."""
    pools = []
    for _ in range(2):
        pool = QuantizedPool(slots or s, 64, h_kv, d, bits, group)
        pool.write(0, mx.array(rng.normal(size=(1, h_kv, s, d)).astype(np.float32)))
        pools.append(pool)
    return pools


# (head_dim, group size) where the head dim allows each group size
DIMS = [(32, 32), (64, 32), (64, 64), (128, 64), (128, 128)]
HEADS = [(2, 2), (4, 2), (4, 1), (8, 2)]  # (H_q, H_kv): equal, GQA x2, x4, x4


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("d, group", DIMS)
@pytest.mark.parametrize("h_q, h_kv", HEADS)
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("kind", list(MaskKind))
def test_attend_over_quantized_pools_equals_numpy_over_the_dequantized_triples(rng, bits, d, group, h_q, h_kv, t, kind):
    s = 11
    kp, vp = filled_pools(rng, h_kv, s, d, bits, group)
    keys, values = kp.read(0, s), vp.read(0, s)
    assert isinstance(keys, QuantizedKV) and keys.shape == (1, h_kv, s, d)
    q = rng.normal(size=(1, h_q, t, d)).astype(np.float32)
    if kind is MaskKind.NONE:
        allowed, mask = np.ones((t, s), dtype=bool), None
    elif kind is MaskKind.CAUSAL:  # lower-right aligned: query i sees keys up to s - t + i
        allowed, mask = np.arange(s)[None, :] <= (s - t + np.arange(t))[:, None], None
    else:
        allowed = rng.random((t, s)) < 0.4
        allowed[np.arange(t), rng.integers(0, s, size=t)] = True  # every row attends something
        mask = mx.array(allowed[None, None])
    scale = d**-0.5
    out = attend(mx.array(q), AttendSpec(keys, values, kind, mask, queries=t), scale)
    assert out.shape == q.shape and out.dtype == mx.float32
    k, v = oracle(keys), oracle(values)
    want = reference(q, k, v, allowed, scale)
    np.testing.assert_allclose(np.array(out), want, atol=1e-5, rtol=1e-5)
    if kind is not MaskKind.NONE and t > 1:  # the mask mattered
        assert not np.allclose(want, reference(q, k, v, np.ones((t, s), dtype=bool), scale), atol=1e-3)


def test_quantized_attention_differs_from_attention_over_the_unquantized_input(rng):
    # The oracle's keys are the quantized ones: q4 moves the result well past the tolerance.
    d, s, t = 64, 9, 3
    x_k, x_v = (rng.normal(size=(1, 2, s, d)).astype(np.float32) for _ in range(2))
    kp, vp = (QuantizedPool(s, s, 2, d, 4, 64) for _ in range(2))
    kp.write(0, mx.array(x_k))
    vp.write(0, mx.array(x_v))
    q = rng.normal(size=(1, 4, t, d)).astype(np.float32)
    out = np.array(attend(mx.array(q), AttendSpec(kp.read(0, s), vp.read(0, s), MaskKind.NONE), d**-0.5))
    ones = np.ones((t, s), dtype=bool)
    want = reference(q, oracle(kp.read(0, s)), oracle(vp.read(0, s)), ones, d**-0.5)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    assert np.abs(out - reference(q, x_k, x_v, ones, d**-0.5)).max() > 1e-3


@pytest.mark.parametrize("bits, group", [(8, 32), (4, 64)])
def test_groups_over_quantized_pools_gather_each_groups_cells(rng, bits, group):
    # 5 tokens in 2 gathered groups over a pool of 12 cells, then the same tokens with a paged
    # batch (pages of 4, a tail) beside a gathered one: both equal numpy over the dense mask.
    d, h_q, h_kv, slots = 64, 4, 2, 12
    kp, vp = filled_pools(rng, h_kv, slots, d, bits, group)
    keys, values = kp.read(0, slots), vp.read(0, slots)
    q = rng.normal(size=(1, h_q, 5, d)).astype(np.float32)
    i32 = lambda rows: mx.array(np.array(rows, dtype=np.int32))  # noqa: E731
    tokens, cells = [[0, 3, 3], [1, 2, 4]], [[2, 5, 0], [1, 7, 11]]
    gmask = np.array([[[1, 0, 0], [1, 1, 0], [1, 1, 0]], [[1, 0, 0], [1, 1, 0], [1, 1, 1]]], dtype=bool)
    out = [0, 3, 4, 1, 5]
    allowed = np.zeros((5, slots), dtype=bool)
    for g in range(2):
        for i in range(3):
            for j in range(3):
                allowed[tokens[g][i], cells[g][j]] |= gmask[g, i, j]
    groups = AttendGroups(i32(tokens), i32(cells), mx.array(gmask)[:, None], i32(out), keys, values)
    spec = AttendSpec(keys, values, MaskKind.EXPLICIT, mx.array(allowed[None, None]), groups, queries=5)
    want = reference(q, oracle(keys), oracle(values), allowed, d**-0.5)
    np.testing.assert_allclose(np.array(attend(mx.array(q), spec, d**-0.5)), want, atol=1e-5, rtol=1e-5)

    # tokens 0 and 2: page 1 (cells 4-7, cell 6 masked) and tail cells 10, 0; tokens 1, 3, 4 gathered
    pmask = np.array([[[1, 1, 0, 1, 1, 1], [1, 0, 1, 1, 0, 1]]], dtype=bool)  # [G, Qg, P * B + Kt]
    gmask = np.array([[[1, 0, 0], [1, 1, 0], [1, 1, 1]]], dtype=bool)  # [G, Qg, Kg]
    gathered = AttendBatch(i32([[1, 3, 4]]), i32([[9, 2, 3]]), mx.array(gmask)[:, None])
    paged = AttendGroups(
        i32([[0, 2]]), i32([[1]]), mx.array(pmask)[:, None], i32([0, 2, 1, 3, 4]), keys, values,
        more=(gathered,), page=4, tail=i32([[10, 0]]),
    )
    allowed = np.zeros((5, slots), dtype=bool)
    allowed[0, [4, 5, 7, 10, 0]] = allowed[2, [4, 6, 7, 0]] = True
    allowed[1, [9]] = allowed[3, [9, 2]] = allowed[4, [9, 2, 3]] = True
    spec = AttendSpec(keys, values, MaskKind.EXPLICIT, mx.array(allowed[None, None]), paged, queries=5)
    want = reference(q, oracle(keys), oracle(values), allowed, d**-0.5)
    np.testing.assert_allclose(np.array(attend(mx.array(q), spec, d**-0.5)), want, atol=1e-5, rtol=1e-5)


# -- QuantizedPool -----------------------------------------------------------------------------

H, D = 2, 64


def tokens(rng, n, heads=H, dim=D) -> mx.array:
    return mx.array(rng.normal(size=(1, heads, n, dim)).astype(np.float32))  # [1, H, n, D]


def expected(x: mx.array, bits: int, group: int) -> QuantizedKV:
    """mx.quantize's triple of the float16-cast input: what a pool must store."""
    return QuantizedKV(*mx.quantize(x.astype(mx.float16), group_size=group, bits=bits), bits, group)


def contents(pool: QuantizedPool) -> tuple:
    """Everything a refusal must leave as it was: each part's slots and every bit of every slot."""
    return (pool.slots, pool.packed.slots, pool.scales.slots, pool.biases.slots), bits_of(pool.read(0, pool.slots))


def assert_unchanged(pool: QuantizedPool, before: tuple) -> None:
    after = contents(pool)
    assert after[0] == before[0]
    for a, b in zip(after[1], before[1], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bits, group", [(8, 32), (8, 64), (4, 32), (4, 64)])
def test_a_write_stores_mx_quantize_of_the_float16_input(rng, bits, group):
    pool = QuantizedPool(4, 16, H, D, bits, group)
    x = tokens(rng, 3)
    pool.write(1, x)
    got = pool.read(1, 3)
    assert (got.bits, got.group_size) == (bits, group)
    assert got.packed.dtype == mx.uint32 and got.scales.dtype == got.biases.dtype == mx.float16
    assert got.packed.shape == (1, H, 3, D * bits // 32) and got.scales.shape == (1, H, 3, D // group)
    assert same_bits(got, expected(x, bits, group))
    within_a_step(oracle(got), np.array(x.astype(mx.float16)), np.array(got.scales), group)
    assert not np.array(pool.read(0, 1).packed).any()  # slot 0 untouched: still zero


def test_a_float16_model_and_a_float32_one_store_the_same_bits(rng):
    x = tokens(rng, 2)
    a, b = QuantizedPool(2, 2, H, D, 4, 64), QuantizedPool(2, 2, H, D, 4, 64)
    a.write(0, x)
    b.write(0, x.astype(mx.float16))
    assert same_bits(a.read(0, 2), b.read(0, 2))


def test_write_cells_scatters_and_take_gathers_them_back(rng):
    pool = QuantizedPool(2, 32, H, D, 4, 32)
    x = tokens(rng, 4)
    cells = [9, 1, 20, 5]
    pool.write_cells(cells, x)
    assert pool.slots == 32  # 2 -> 4 -> 8 -> 16 -> 32 to hold cell 20
    assert same_bits(pool.take(cells), expected(x, 4, 32))
    assert same_bits(pool.take(mx.array([5, 20], dtype=mx.int32)), expected(x[:, :, [3, 2]], 4, 32))
    rest = [c for c in range(32) if c not in cells]
    untouched = pool.take(rest)
    assert not any(part.any() for part in bits_of(untouched))


def test_a_quantized_update_is_stored_bit_for_bit(rng):
    # Words and scales no quantization of floats would give: stored as they are, never re-quantized.
    n = 3
    packed = mx.array(rng.integers(0, 2**32, size=(1, H, n, D * 8 // 32), dtype=np.uint64).astype(np.uint32))
    scales = mx.array(rng.normal(size=(1, H, n, D // 32)).astype(np.float16))
    biases = mx.array(rng.normal(size=(1, H, n, D // 32)).astype(np.float16))
    update = QuantizedKV(packed, scales, biases, 8, 32)
    pool = QuantizedPool(2, 16, H, D, 8, 32)
    pool.write(4, update)
    assert same_bits(pool.read(4, n), update)
    other = QuantizedPool(2, 16, H, D, 8, 32)
    other.write_cells([7, 0, 3], update)
    assert same_bits(other.take([7, 0, 3]), update)


def test_growth_by_doubling_keeps_every_earlier_cell(rng):
    pool = QuantizedPool(2, 40, H, D, 8, 64)
    first, second, third = tokens(rng, 2), tokens(rng, 1), tokens(rng, 3)
    pool.write(0, first)
    assert pool.slots == 2
    pool.write(6, second)
    assert (pool.slots, pool.packed.slots, pool.scales.slots, pool.biases.slots) == (8, 8, 8, 8)
    pool.write_cells([30, 17, 9], third)
    assert pool.slots == 32  # 8 -> 16 -> 32
    pool.write(37, second)
    assert pool.slots == 40  # 64 clamped to max_slots
    assert same_bits(pool.read(0, 2), expected(first, 8, 64))
    assert same_bits(pool.read(6, 1), expected(second, 8, 64))
    assert same_bits(pool.take([30, 17, 9]), expected(third, 8, 64))
    assert same_bits(pool.read(37, 1), expected(second, 8, 64))
    assert pool.nbytes == pool_bytes(40, H, D, "q8", 64) == 40 * H * (64 + 2 * 1 * 2)


def test_an_empty_update_writes_nothing_and_allocates_nothing(rng):
    pool = QuantizedPool(2, 16, H, D, 4, 64)
    pool.write(0, tokens(rng, 2))
    before = contents(pool)
    pool.write(10, mx.zeros((1, H, 0, D)))
    pool.write_cells([], mx.zeros((1, H, 0, D)))
    assert_unchanged(pool, before)


def _other_bits() -> QuantizedKV:
    x = mx.zeros((1, H, 1, D)).astype(mx.float16)
    return QuantizedKV(*mx.quantize(x, group_size=64, bits=8), 8, 64)


def _other_group() -> QuantizedKV:
    x = mx.zeros((1, H, 1, D)).astype(mx.float16)
    return QuantizedKV(*mx.quantize(x, group_size=32, bits=4), 4, 32)


def _float32_scales() -> QuantizedKV:
    packed, scales, biases = mx.quantize(mx.zeros((1, H, 1, D)), group_size=64, bits=4)
    return QuantizedKV(packed, scales.astype(mx.float32), biases.astype(mx.float32), 4, 64)


# (what is written, how): every one refused with KVLayoutError, the pool exactly as it was.
REFUSED = [
    pytest.param(lambda: mx.zeros((1, H + 1, 1, D)), "write", id="wrong-heads"),
    pytest.param(lambda: mx.zeros((1, H, 1, D // 2)), "write", id="wrong-head-dim"),
    pytest.param(lambda: mx.zeros((H, 1, D)), "write", id="three-dims"),
    pytest.param(lambda: mx.zeros((2, H, 1, D)), "write", id="batch-of-two"),
    pytest.param(lambda: mx.zeros((1, H, 1, D), dtype=mx.int32), "write", id="int32-array"),
    pytest.param(lambda: mx.zeros((1, H, 1, D), dtype=mx.uint32), "write_cells", id="uint32-array-cells"),
    pytest.param(lambda: np.zeros((1, H, 1, D), dtype=np.float32), "write", id="numpy-array"),
    pytest.param(lambda: [[0.0] * D], "write", id="a-list"),
    pytest.param(_other_bits, "write", id="quantized-at-8-bits"),
    pytest.param(_other_group, "write_cells", id="quantized-at-group-32"),
    pytest.param(_float32_scales, "write", id="quantized-float32-scales"),
]


@pytest.fixture
def q4_pool(rng) -> QuantizedPool:
    """A q4 pool (group 64) of 4 slots (max 8), every slot written."""
    pool = QuantizedPool(4, 8, H, D, 4, 64)
    pool.write(0, tokens(rng, 4))
    return pool


@pytest.mark.parametrize("make, verb", REFUSED)
def test_a_refused_update_leaves_the_pool_as_it_was(q4_pool, make, verb):
    before = contents(q4_pool)
    with pytest.raises(KVLayoutError):
        if verb == "write":
            q4_pool.write(2, make())
        else:
            q4_pool.write_cells([1], make())
    assert_unchanged(q4_pool, before)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda p, x: p.write_cells([1, 3, 1], x), id="repeated-cell"),
        pytest.param(lambda p, x: p.write_cells([2, 8, 0], x), id="cell-at-max-slots"),
        pytest.param(lambda p, x: p.write_cells([-1, 2, 3], x), id="negative-cell"),
        pytest.param(lambda p, x: p.write_cells([6, 5], x), id="too-few-cells"),
        pytest.param(lambda p, x: p.write(6, x), id="write-past-max-slots"),
        pytest.param(lambda p, x: p.write(-1, x), id="negative-start"),
    ],
)
def test_refused_cells_leave_the_pool_as_it_was(q4_pool, rng, call):
    before = contents(q4_pool)
    x = tokens(rng, 3)
    with pytest.raises(KVLayoutError):
        call(q4_pool, x)
    assert_unchanged(q4_pool, before)
    # and a refused quantized update the same way
    with pytest.raises(KVLayoutError):
        call(q4_pool, expected(x, 4, 64))
    assert_unchanged(q4_pool, before)


def _disagreeing(n_packed: int, n_groups: int, heads_groups: int = H) -> QuantizedKV:
    """A triple whose packed words hold `n_packed` tokens and whose scales/biases hold `n_groups`
    tokens of `heads_groups` heads: no quantization gives it, so a pool must refuse it whole."""
    packed, scales, biases = mx.quantize(mx.ones((1, H, n_packed, D), dtype=mx.float16), group_size=64, bits=4)
    sb = mx.ones((1, heads_groups, n_groups, 1), dtype=mx.float16)
    return QuantizedKV(packed, sb, sb, 4, 64)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda p: p.write(2, _disagreeing(3, 2)), id="write-3-words-2-scales"),
        pytest.param(lambda p: p.write(1, _disagreeing(1, 1, heads_groups=H + 1)), id="write-scales-of-other-heads"),
        pytest.param(lambda p: p.write_cells([0, 5, 6], _disagreeing(3, 2)), id="write-cells-3-words-2-scales"),
    ],
)
def test_a_triple_whose_parts_disagree_is_refused_and_changes_nothing(q4_pool, call):
    before = contents(q4_pool)
    with pytest.raises(KVLayoutError):
        call(q4_pool)
    assert_unchanged(q4_pool, before)


def test_a_refusal_that_would_have_grown_the_pool_grows_nothing(rng):
    pool = QuantizedPool(2, 8, H, D, 8, 32)
    pool.write(0, tokens(rng, 2))
    before = contents(pool)
    with pytest.raises(KVLayoutError):
        pool.write_cells([7, 7], tokens(rng, 2))
    with pytest.raises(KVLayoutError):
        pool.write(5, tokens(rng, 1, heads=H + 1))
    assert_unchanged(pool, before)


@pytest.mark.parametrize("bits, group, dim", [(2, 32, 64), (3, 32, 96), (4, 64, 48), (8, 128, 64)])
def test_a_pool_that_cannot_hold_whole_groups_or_bits_is_refused(bits, group, dim):
    with pytest.raises(KVLayoutError):
        QuantizedPool(2, 8, H, dim, bits, group)


def test_kv_pool_builds_the_pool_the_config_asks_for():
    layers = [LayerConfig(H, D)]
    q = kv_pool(2, 8, H, D, CacheConfig(capacity=8, n_layers=1, layers=layers, kv_dtype="q4", kv_group_size=32))
    assert isinstance(q, QuantizedPool) and (q.bits, q.group_size, q.n_heads, q.head_dim) == (4, 32, H, D)
    f = kv_pool(2, 8, H, D, CacheConfig(capacity=8, n_layers=1, layers=layers, kv_dtype="bfloat16"))
    assert isinstance(f, MLXPool) and f.dtype == mx.bfloat16


# -- CacheConfig -------------------------------------------------------------------------------


def config(**overrides) -> CacheConfig:
    kwargs = dict(capacity=64, n_layers=2, layers=[LayerConfig(2, 64)], kv_dtype="q4")
    kwargs.update(overrides)
    return CacheConfig(**kwargs)


def test_q4_with_a_head_dim_no_group_of_64_divides_is_refused_naming_head_dim():
    with pytest.raises(ConfigError, match=r"head_dim=48 does not divide into groups of 64.*a float kv_dtype"):
        config(layers=[LayerConfig(2, 48)], kv_group_size=64)
    with pytest.raises(ConfigError, match=r"layer 1's head_dim=96 .*groups of 64; expected a kv_group_size of 32"):
        config(layers=[LayerConfig(2, 64), LayerConfig(2, 96)], kv_group_size=64)
    assert config(layers=[LayerConfig(2, 64), LayerConfig(2, 96)], kv_group_size=32).kv_bits == 4


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_a_group_size_with_a_float_kv_dtype_is_refused(dtype):
    with pytest.raises(ConfigError, match=rf"kv_group_size=32 with kv_dtype='{dtype}'"):
        config(kv_dtype=dtype, kv_group_size=32)
    assert config(kv_dtype=dtype).kv_bits is None  # the default group size is no mistake


@pytest.mark.parametrize("group", [16, 0, 256, 64.0, "64", True])
def test_a_group_size_mlx_does_not_implement_is_refused(group):
    with pytest.raises(ConfigError, match="kv_group_size"):
        config(kv_group_size=group)


@pytest.mark.parametrize("dtype, group", [("q8", 32), ("q4", 128), ("q4", 64), ("q8", 64)])
def test_a_quantized_config_round_trips_through_a_mapping(dtype, group):
    c = config(kv_dtype=dtype, kv_group_size=group, layers=[LayerConfig(2, 128)])
    m = c.to_mapping()
    assert m["kv_dtype"] == dtype
    assert m.get("kv_group_size", 64) == group
    back = CacheConfig.from_mapping(m)
    assert back == c and (back.kv_bits, back.kv_group_size) == ({"q8": 8, "q4": 4}[dtype], group)


def test_a_refused_config_raises_before_any_pool_is_built(monkeypatch):
    import kvlayout_cell.cache
    import kvlayout_seq.mlx_cache

    built = []
    for module in (kvlayout_cell.cache, kvlayout_seq.mlx_cache):
        monkeypatch.setattr(module, "kv_pool", lambda *a, **k: built.append(a))
    bad = dict(capacity=64, n_layers=1, layers=[dict(n_kv_heads=2, head_dim=48)], kv_dtype="q4", kv_group_size=64)
    for kind in ("cell", "seq"):
        with pytest.raises(ConfigError, match="head_dim=48"):
            kvlayout.build("mlx", kind, bad)
    assert built == []


# -- bytes -------------------------------------------------------------------------------------


def test_pool_bytes_counts_packed_words_scales_and_biases():
    # q4, D = 64, group 64: 32 bytes of words + one float16 scale and bias = 36 bytes a head-row
    assert slot_bytes(64, "q4", 64) == 36
    assert pool_bytes(1, 3, 64, "q4", 64) == 3 * 36
    assert pool_bytes(10, 3, 64, "q4", 64) == 1080
    # q8, D = 128, group 32: 128 bytes + 4 groups x (2 + 2) = 144
    assert pool_bytes(5, 2, 128, "q8", 32) == 5 * 2 * 144
    # q4, D = 128, group 128: 64 + 4 = 68; float16 D = 64: 128; float32: 256
    assert slot_bytes(128, "q4", 128) == 68
    assert pool_bytes(2, 3, 64, "float16") == 2 * 3 * 128
    assert pool_bytes(2, 3, 64, "float32") == 2 * 3 * 256


def test_pool_bytes_is_what_a_quantized_pool_holds():
    for bits, dtype, group in ((4, "q4", 64), (8, "q8", 32), (4, "q4", 128)):
        pool = QuantizedPool(12, 12, 3, 128, bits, group)
        assert pool.nbytes == pool_bytes(12, 3, 128, dtype, group)


def test_cell_bytes_sums_k_and_v_over_every_layer():
    c = config(layers=[LayerConfig(3, 64)], kv_group_size=64)  # 2 layers, q4
    assert cell_bytes(c) == 2 * 2 * 3 * 36 == 432
    assert cell_bytes(c, "float16") == 2 * 2 * 3 * 64 * 2 == 1536
    assert cell_bytes(c, "q8") == 2 * 2 * 3 * (64 + 4) == 816
    mixed = config(kv_dtype="q8", kv_group_size=32, layers=[LayerConfig(1, 64), LayerConfig(4, 128)])
    assert cell_bytes(mixed) == 2 * (1 * (64 + 2 * 2 * 2)) + 2 * (4 * (128 + 4 * 2 * 2)) == 2 * 72 + 2 * 576
