"""Bad input to every entry point of the seq layout: a KVLayoutError naming the argument, nothing changed.

The cache is flat + ring(4) with max_write=2 at length 10 (the ring has
wrapped: steps may start in [8, 10]). Every row makes one call with one bad
argument; afterwards the length, the rewind floor, every ring's record and
every pool byte are as before, and the corrected step still goes through.
Protocol refusals of well-formed steps (a gap, older than the ring holds,
past capacity, longer than max_write) are in test_refusals.py.
"""

from __future__ import annotations

import math
import re

import mlx.core as mx
import numpy as np
import pytest

import kvlayout.config
from kvlayout import ConfigError, KVLayoutError, StepError
from kvlayout_seq.mlx_cache import SeqCache
from tests.seq.support import D, H, assert_same, one, snapshot, wrapped_cache

HUGE, BIG, U64 = 2**70, 2**62, 2**63


@pytest.fixture
def cache():
    return wrapped_cache()


def still_works(cache) -> None:
    """The corrected step goes through on every layer."""
    for layer in range(cache.n_layers):
        cache.update_and_fetch(layer, [10], one(), one())
    assert cache.as_control().length == 11


K, V = one(), one(seed=10)

UPDATE = {
    "layer a string": (("0", [10], K, V), "layer='0'"),
    "layer a float": ((0.0, [10], K, V), "layer=0.0"),
    "layer None": ((None, [10], K, V), "layer=None"),
    "layer NaN": ((math.nan, [10], K, V), "layer=nan"),
    "layer 2**70": ((HUGE, [10], K, V), f"layer={HUGE}"),
    "positions None": ((0, None, K, V), "positions"),
    "positions an int": ((0, 10, K, V), "positions"),
    "positions a string": ((0, "10", K, V), "positions"),
    "positions a set": ((0, {10}, K, V), "positions"),
    "positions empty": ((0, [], one(0), one(0)), "positions is empty"),
    "positions inf in a list": ((0, [math.inf], K, V), "positions.*inf"),
    "positions NaN in a list": ((0, [math.nan], K, V), "positions.*nan"),
    "positions numpy inf": ((0, np.array([np.inf]), K, V), "positions.*float64"),
    "positions numpy float32": ((0, np.array([10], np.float32), K, V), "positions.*float32"),
    "positions mlx float16": ((0, mx.array([10], dtype=mx.float16), K, V), "positions.*float16"),
    "positions 2**62": ((0, [BIG], K, V), f"positions start at {BIG}"),
    "positions 2**63": ((0, [U64], K, V), rf"positions.*(?<!-)\b{U64}\b"),
    "positions 2**63 as uint64": ((0, np.array([U64], np.uint64), K, V), rf"positions.*(?<!-)\b{U64}\b"),
    "positions 2**63 as mlx uint64": ((0, mx.array(np.array([U64], np.uint64)), K, V), rf"positions.*(?<!-)\b{U64}\b"),
    "positions -2**70": ((0, [-HUGE], K, V), "positions"),
    "positions negative": ((0, [-1], K, V), "start at -1"),
    "positions a numpy bool": ((0, [np.bool_(True)], K, V), "positions.*True"),
    "k int32": ((0, [10], one(dtype=mx.int32), V), r"\bk\b.*int32"),
    "k bool": ((0, [10], one(dtype=mx.bool_), V), r"\bk\b.*bool"),
    "v uint8": ((0, [10], K, one(dtype=mx.uint8)), r"\bv\b.*uint8"),
    "v complex": ((0, [10], K, one(dtype=mx.complex64)), r"\bv\b.*complex64"),
    "k None": ((0, [10], None, V), r"\bk\b"),
    "k a list": ((0, [10], [[[[0.0] * D] * 1] * H], V), r"\bk\b"),
    "v numpy": ((0, [10], K, np.array(V)), r"\bv\b"),
    "k 3-d": ((0, [10], K[0], V), r"\bk\b"),
    "k batch of 2": ((0, [10], mx.concatenate([K, K]), V), r"\bk\b"),
    "v wrong heads": ((0, [10], K, one(heads=H + 1)), r"\bv\b"),
    "k wrong head_dim": ((1, [10], one(dim=D + 1), V), r"\bk\b"),
    "k two tokens, positions one": ((0, [10], one(2), one(2)), r"\bk\b.*2 token"),
    "v two tokens, k one": ((0, [10], K, one(2)), r"\bv\b.*2 token"),
}


@pytest.mark.parametrize("args, message", UPDATE.values(), ids=UPDATE.keys())
def test_a_bad_update_and_fetch_is_refused_by_name_and_changes_nothing(cache, args, message):
    before = snapshot(cache)
    with pytest.raises(StepError) as info:
        cache.update_and_fetch(*args)
    assert re.search(message, str(info.value)), str(info.value)
    assert_same(snapshot(cache), before)
    still_works(cache)


VERBS = {
    "rewind: a string": ("rewind", ("8",), "new_len='8'"),
    "rewind: a float": ("rewind", (8.0,), "new_len=8.0"),
    "rewind: NaN": ("rewind", (math.nan,), "new_len=nan"),
    "rewind: inf": ("rewind", (math.inf,), "new_len=inf"),
    "rewind: None": ("rewind", (None,), "new_len=None"),
    "rewind: a bool": ("rewind", (True,), "new_len=True"),
    "rewind: negative": ("rewind", (-1,), "new_len=-1"),
    "rewind: -2**70": ("rewind", (-HUGE,), f"new_len=-{HUGE}"),
    "rewind: a numpy float": ("rewind", (np.float64(9),), "new_len="),
    "can_extend: a string": ("can_extend", ("1",), "n='1'"),
    "can_extend: a float": ("can_extend", (1.0,), "n=1.0"),
    "can_extend: NaN": ("can_extend", (math.nan,), "n=nan"),
    "can_extend: None": ("can_extend", (None,), "n=None"),
    "can_extend: negative": ("can_extend", (-1,), "n=-1"),
}


@pytest.mark.parametrize("verb, args, message", VERBS.values(), ids=VERBS.keys())
def test_a_bad_count_is_refused_by_name_and_changes_nothing(cache, verb, args, message):
    before = snapshot(cache)
    with pytest.raises(KVLayoutError) as info:
        getattr(cache.as_control(), verb)(*args)
    assert isinstance(info.value, StepError), type(info.value)
    assert message in str(info.value), str(info.value)
    assert_same(snapshot(cache), before)
    still_works(cache)


@pytest.mark.parametrize("verb, args", [("rewind", (2**70,)), ("can_extend", (2**70,)), ("rewind", (11,))])
def test_a_count_too_large_is_an_answer_not_an_error(cache, verb, args):
    before = snapshot(cache)
    assert getattr(cache.as_control(), verb)(*args) is False
    assert_same(snapshot(cache), before)


# -- calls in the middle of a forward ------------------------------------------------------------

# Layer 0 has written the step at 10, layer 1 not yet. A rewind keeping position 10, or a step
# starting past it, would leave it unwritten in layer 1 (read as zeros ever after): refused.
MID_FORWARD = {
    "rewind to the length": (
        lambda c, d: c.as_control().rewind(11), r"rewind\(new_len=11\) during a forward: layer\(s\) \[1\]"),
    "rewind past the length": (lambda c, d: c.as_control().rewind(12), r"rewind\(new_len=12\) during a forward"),
    "a step past it, layer 0": (lambda c, d: c.update_and_fetch(0, [11], K, V), r"start at 11, past the step at 10"),
    "a step past it, layer 1": (lambda c, d: c.update_and_fetch(1, [11], K, V), r"start at 11, past the step at 10"),
    "save": (lambda c, d: c.save(d / "c.kv"), r"save during a forward: layer\(s\) \[1\]"),
}


@pytest.mark.parametrize("call, message", MID_FORWARD.values(), ids=MID_FORWARD.keys())
def test_a_call_in_the_middle_of_a_forward_is_refused_and_changes_nothing(cache, tmp_path, call, message):
    cache.update_and_fetch(0, [10], one(), one())
    before = snapshot(cache)
    with pytest.raises(StepError, match=message):
        call(cache, tmp_path)
    assert_same(snapshot(cache), before)
    assert list(tmp_path.iterdir()) == []
    cache.update_and_fetch(1, [10], one(), one())  # the forward goes on
    assert (cache.as_control().length, cache.book.open_step()) == (11, None)


LAYER = {"n_kv_heads": H, "head_dim": D}

CONFIGS = {
    "None": (None, "config"),
    "a string": ("capacity=8", "config"),
    "a list": ([("capacity", 8)], "config"),
    "capacity zero": ({"capacity": 0, "n_layers": 1, "layers": [LAYER]}, "capacity"),
    "capacity 2**70 as a float": ({"capacity": float(HUGE), "n_layers": 1, "layers": [LAYER]}, "capacity"),
    "an unknown key": ({"capacity": 8, "n_layers": 1, "layers": [LAYER], "window": 4}, "window"),
    "a ring without a window": (
        {"capacity": 8, "n_layers": 1, "layers": [{**LAYER, "policy": {"kind": "ring"}}]}, "window"),
}


@pytest.mark.parametrize("config, message", CONFIGS.values(), ids=CONFIGS.keys())
def test_a_cache_from_a_bad_config_is_refused_by_name(config, message):
    with pytest.raises(ConfigError, match=message):
        SeqCache(config)


# -- sizes: what a cache allocates up front, against the machine ------------------------------

RING = {**LAYER, "policy": {"kind": "ring", "window": 10**12}}
SIZES = {
    "capacity 10**12": (
        {"capacity": 10**12, "n_layers": 2, "layers": [LAYER]},
        r"capacity=1000000000000: layer 0's pools would span 1000000000000 slots"),
    "capacity 2**63-1": (
        {"capacity": 2**63 - 1, "n_layers": 1, "layers": [LAYER]}, rf"capacity={2**63 - 1}: .*past the 2147483647"),
    "capacity 2**31": ({"capacity": 2**31, "n_layers": 1, "layers": [LAYER]}, r"2147483648 slots .*lower capacity"),
    "a ring of 10**12 over capacity 2**31": (
        {"capacity": 2**31, "n_layers": 2, "layers": [LAYER, RING]}, r"layer 0's pools"),
    "a ring of 10**12 mirrored": (
        {"capacity": 2**31 - 1, "n_layers": 1, "max_write": 1,
         "layers": [{**LAYER, "policy": {"kind": "ring", "window": 2**30 + 10}}]},
        r"2147483668 slots \(a ring of window=1073741834 and max_write=1 keeps 1073741834, twice over"),
    "n_kv_heads 2**40": (
        {"capacity": 8, "n_layers": 1, "initial_capacity": 0, "layers": [{"n_kv_heads": 2**40, "head_dim": D}]},
        rf"LayerConfig.n_kv_heads={2**40}: expected at most 2147483647"),
    "head_dim 2**33": (
        {"capacity": 8, "n_layers": 1, "initial_capacity": 0, "layers": [{"n_kv_heads": H, "head_dim": 2**33}]},
        rf"LayerConfig.head_dim={2**33}: expected at most 2147483647"),
}


@pytest.mark.parametrize("config, message", SIZES.values(), ids=SIZES.keys())
def test_a_cache_no_mlx_pool_can_span_is_a_config_error_stating_its_bytes(config, message):
    # It built before, and failed later: OverflowError from mx.zeros, or a can_extend that promised
    # positions no pool could hold.
    with pytest.raises(ConfigError, match=message) as info:
        SeqCache(config)
    assert "at capacity the pools would hold" in str(info.value) or "MLX array dimensions are int32" in str(info.value)


def test_the_bytes_allocated_at_build_are_refused_exactly_past_the_machine_s_memory(monkeypatch):
    # flat: initial_capacity 16 slots; ring of 8 (max_write 8): 15 slots, mirrored (30), whole.
    # 32 B a slot (2 heads x 4 dims x float32), a K and a V pool per layer.
    need = 2 * 16 * 32 + 2 * 30 * 32
    config = {"capacity": 100, "n_layers": 2, "kv_dtype": "float32", "initial_capacity": 16,
              "layers": [LAYER, {**LAYER, "policy": {"kind": "ring", "window": 8}}]}
    monkeypatch.setattr(kvlayout.config, "machine_memory", lambda: need)
    assert SeqCache(config).nbytes == need
    monkeypatch.setattr(kvlayout.config, "machine_memory", lambda: need - 1)
    with pytest.raises(ConfigError, match=rf"capacity=100: allocates .* \({need} bytes\) up front .*rings whole"):
        SeqCache(config)


# A later layer of a forward takes the step its first layer planned (the book's open step): its own
# K/V are still checked, before it counts as served.
LATER_KV = {
    "k of another head count": (lambda: one(heads=H + 1), one), "v of another length": (one, lambda: one(n=2)),
    "k an int array": (lambda: mx.zeros((1, H, 1, D), dtype=mx.int32), one), "v a list": (one, lambda: [[0.0]]),
}


@pytest.mark.parametrize("k, v", LATER_KV.values(), ids=LATER_KV.keys())
def test_a_later_layers_bad_kv_is_refused_naming_the_layer_and_changes_nothing(cache, k, v):
    cache.update_and_fetch(0, [10], one(), one())
    before = snapshot(cache)
    with pytest.raises(StepError, match=r"layer 1: [kv] "):
        cache.update_and_fetch(1, [10], k(), v())
    assert_same(snapshot(cache), before)
    assert cache.book.open_step() == (10, [1])
    cache.update_and_fetch(1, [10], one(), one())  # the forward goes on
    assert (cache.as_control().length, cache.book.open_step()) == (11, None)
