"""A tiny GQA stack run through the cache equals the cache-free forward over the whole sequence.

The oracle is `TinyStack.forward_reference`: full causal attention for a flat
layer, sliding-window attention for a ring layer, no cache at all.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from kvlayout import CacheConfig, LayerConfig, LayerPolicy
from kvlayout_seq.mlx_cache import SeqCache
from tests.helpers import TinyStack

N = 40
WINDOWS = {"all flat": (0, 0, 0, 0), "flat and ring mix": (0, 4, 3, 4)}
SCHEDULES = {
    "prefill then one token at a time": [24] + [1] * 16,
    "chunked prefill": [7, 7, 7, 7, 7, 5],
    "one token at a time": [1] * N,
}


def build(stack: TinyStack, windows, max_write: int) -> SeqCache:
    layers = [
        LayerConfig(stack.n_kv_heads, stack.head_dim, LayerPolicy("ring", w) if w else LayerPolicy())
        for w in windows
    ]
    config = CacheConfig(
        capacity=48, n_layers=stack.n_layers, layers=layers, kv_dtype="float32",
        initial_capacity=4, max_write=max_write,
    )
    return SeqCache(config)


def run(stack, cache, x, start, chunks) -> list[tuple[int, mx.array]]:
    """Feed `x[:, start:]` chunk by chunk; the output of each chunk with its first position."""
    out = []
    for t in chunks:
        y = stack.forward_cached(cache, x[:, start : start + t], range(start, start + t))
        out.append((start, y))
        start += t
    return out


def assert_matches(outputs, reference):
    for start, y in outputs:
        want = reference[:, start : start + y.shape[1]]
        np.testing.assert_allclose(np.array(y), np.array(want), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "windows, chunks",
    [(WINDOWS[w], SCHEDULES[s]) for w, s in itertools.product(WINDOWS, SCHEDULES)],
    ids=[f"{w}, {s}" for w, s in itertools.product(WINDOWS, SCHEDULES)],
)
def test_incremental_forward_equals_the_cache_free_forward(windows, chunks):
    stack = TinyStack(n_layers=len(windows))
    x = stack.tokens(N, seed=0)
    cache = build(stack, windows, max_write=max(chunks))
    outputs = run(stack, cache, x, 0, chunks)
    assert cache.as_control().length == N
    assert_matches(outputs, stack.forward_reference(x, windows))


@pytest.mark.parametrize("windows", list(WINDOWS.values()), ids=list(WINDOWS))
def test_after_a_rewind_the_forward_equals_the_cache_free_forward_of_the_new_sequence(windows):
    # 30 tokens of x, back to 27, then 13 tokens of y: the result must know nothing of x[27:30].
    stack = TinyStack(n_layers=len(windows))
    x, y = stack.tokens(N, seed=0), stack.tokens(N, seed=1)
    cache = build(stack, windows, max_write=5)
    before = run(stack, cache, x, 0, [5] * 6)
    assert_matches(before, stack.forward_reference(x[:, :30], windows))
    assert cache.as_control().rewind(27)
    spliced = mx.concatenate([x[:, :27], y[:, 27:]], axis=1)
    after = run(stack, cache, spliced, 27, [1, 1, 5, 5, 1])
    assert cache.as_control().length == N
    assert_matches(after, stack.forward_reference(spliced, windows))
