"""Saving and restoring the seq layout: length, ring records and every kept slot, bit for bit."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvlayout
from kvlayout import StateError, StepError, persist
from kvlayout.faces import Persistent
from kvlayout.mlx import attend
from kvlayout.mlx.tensors import to_raw
from kvlayout_seq.mlx_cache import SeqCache
from tests.helpers import TinyStack
from tests.seq.support import kv, make_cache, step

WINDOWS = (0, 4, 0)


def bits(a: mx.array) -> bytes:
    return bytes(to_raw(a).data)


def kept_bits(cache: SeqCache) -> list[bytes]:
    """What the file keeps: a flat layer's [0, length), a ring's every slot."""
    out = []
    for policy, kp, vp in zip(cache.book.layers, cache.key_pools, cache.value_pools):
        n = policy.slots if policy.kind == "ring" else cache.as_control().length
        out += [bits(kp.read(0, n)), bits(vp.read(0, n))]
    return out


def book(cache: SeqCache) -> tuple:
    return cache.as_control().length, cache.book.floor, [getattr(p, "retained", None) for p in cache.book.policies]


def run(stack, cache, x, start):
    positions = list(range(start, start + x.shape[1]))
    for layer, p in enumerate(stack.layers):
        q, k, v = stack.project_qkv(p, x)
        spec = cache.update_and_fetch(layer, positions, k, v)
        x = stack.project_out(p, x, attend(q, spec, stack.scale))
    return np.array(x)


def filled(kv_dtype="float32", n=14, windows=WINDOWS) -> tuple[SeqCache, TinyStack, mx.array]:
    stack = TinyStack(n_layers=len(windows), n_kv_heads=2, head_dim=4)
    x = stack.tokens(32, seed=4)
    cache = make_cache(windows=windows, capacity=64, kv_dtype=kv_dtype)
    for start in range(0, n, 2):
        run(stack, cache, x[:, start : start + 2], start)
    return cache, stack, x


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "float32"])
def test_a_saved_cache_loads_back_bit_for_bit(tmp_path, kv_dtype):
    cache, _, _ = filled(kv_dtype)
    assert cache.book.floor > 0  # the ring has wrapped: its record matters
    back = kvlayout.load(cache.save(tmp_path / "seq.safetensors"))
    assert isinstance(back, SeqCache) and back.config == cache.config
    assert book(back) == book(cache)
    assert kept_bits(back) == kept_bits(cache)


def test_the_seq_cache_has_the_persistent_face():
    assert isinstance(make_cache(), Persistent)


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
@pytest.mark.parametrize("n", [14, 16])  # the ring's 7 slots: saved at slot 0, and with 2 past the wrap
def test_a_restored_cache_generates_exactly_as_the_original_goes_on(tmp_path, kv_dtype, n):
    cache, stack, x = filled(kv_dtype, n=n)
    back = kvlayout.load(cache.save(tmp_path / "seq.safetensors"))
    for start in range(n, n + 10, 2):
        np.testing.assert_array_equal(
            run(stack, back, x[:, start : start + 2], start), run(stack, cache, x[:, start : start + 2], start)
        )


def test_rewind_after_a_restore_is_bounded_as_before(tmp_path):
    cache, _, _ = filled()
    back = kvlayout.load(cache.save(tmp_path / "seq.safetensors"))
    floor = cache.book.floor
    assert back.as_control().rewind(floor - 1) is False and cache.as_control().rewind(floor - 1) is False
    assert back.as_control().rewind(floor) and cache.as_control().rewind(floor)


def test_an_empty_cache_round_trips(tmp_path):
    cache = make_cache(windows=WINDOWS)
    back = kvlayout.load(cache.save(tmp_path / "e.safetensors"))
    assert book(back) == book(cache) == (0, 0, [None, 0])


def test_saving_in_the_middle_of_a_forward_is_refused(tmp_path):
    cache = make_cache(windows=(0, 0))
    k, v = kv(2)
    step(cache, 0, k, v, layer=0)
    with pytest.raises(StepError, match=r"layer\(s\) \[1\] have not written the step at 0"):
        cache.save(tmp_path / "x.safetensors")
    step(cache, 0, k, v, layer=1)
    cache.save(tmp_path / "x.safetensors")


def test_a_state_whose_length_is_past_the_tensors_is_refused(tmp_path):
    cache, _, _ = filled()
    good = persist.read_state(cache.save(tmp_path / "good.safetensors"))
    state = {**good.state, "length": good.state["length"] + 1}
    persist.save_state(
        tmp_path / "bad.safetensors",
        layout="mlx:seq",
        content="cache",
        config=cache.config,
        state=state,
        tensors=good.tensors,
    )
    with pytest.raises(StateError, match="tensor 'k.0' is F32\\[1, 2, 14, 4\\], expected F32\\[1, 2, 15, 4\\]"):
        kvlayout.load(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("state", [{"length": 99}, {"retained": [0]}, {"retained": [0, 50]}, {"state_version": 7}])
def test_a_state_that_breaks_the_books_is_refused(tmp_path, state):
    cache, _, _ = filled()
    good = persist.read_state(cache.save(tmp_path / "good.safetensors"))
    persist.save_state(
        tmp_path / "bad.safetensors",
        layout="mlx:seq",
        content="cache",
        config=cache.config,
        state={**good.state, **state},
        tensors=good.tensors,
    )
    with pytest.raises(StateError, match="state"):
        kvlayout.load(tmp_path / "bad.safetensors")
