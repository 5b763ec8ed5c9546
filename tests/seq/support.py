"""Builders shared by the seq tests: caches from a few numbers, tokens with known K/V."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvlayout import CacheConfig, LayerConfig, LayerPolicy
from kvlayout_seq.mlx_cache import SeqCache

H, D = 2, 4


def layer(window: int = 0, heads: int = H, dim: int = D) -> LayerConfig:
    policy = LayerPolicy("ring", window) if window else LayerPolicy()
    return LayerConfig(heads, dim, policy)


def make_cache(windows=(0,), capacity=32, kv_dtype="float32", **kw) -> SeqCache:
    """A cache with one layer per entry of `windows` (0 = flat, w = ring of window w)."""
    return SeqCache(
        CacheConfig(
            capacity=capacity,
            n_layers=len(windows),
            layers=[layer(w) for w in windows],
            kv_dtype=kv_dtype,
            **kw,
        )
    )


def kv(n: int, seed: int = 0, dtype=mx.float32) -> tuple[mx.array, mx.array]:
    """`n` tokens of random K and V, `[1, H, n, D]`, reproducible by seed."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(1, H, n, D)).astype(np.float32)
    v = rng.normal(size=(1, H, n, D)).astype(np.float32)
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def step(cache: SeqCache, start: int, k: mx.array, v: mx.array, layer: int = 0):
    """Feed `k`, `v` at consecutive positions from `start` to one layer."""
    return cache.update_and_fetch(layer, list(range(start, start + k.shape[2])), k, v)


def tokens(k: mx.array, idx) -> np.ndarray:
    """Tokens `idx` of a `[1, H, n, D]` array, in that order, as numpy."""
    return np.array(k)[:, :, list(idx), :]


def rows(mask) -> list[str]:
    """A bool `[.., T, S]` mask as strings of 0/1, one per query row."""
    m = np.array(mask).reshape(-1, np.array(mask).shape[-1])
    return ["".join("1" if x else "0" for x in row) for row in m]


def snapshot(cache: SeqCache) -> dict:
    """Everything a refused call must leave as it was: counts, ring records, every pool byte."""
    return dict(
        length=cache.as_control().length,
        floor=cache.book.floor,
        retained=[getattr(p, "retained", None) for p in cache.book.policies],
        slots=[p.slots for p in cache.key_pools + cache.value_pools],
        bytes=[np.array(p.read(0, p.slots)) for p in cache.key_pools + cache.value_pools],
    )


def assert_same(a: dict, b: dict) -> None:
    assert {k: a[k] for k in a if k != "bytes"} == {k: b[k] for k in b if k != "bytes"}
    for x, y in zip(a["bytes"], b["bytes"], strict=True):
        np.testing.assert_array_equal(x, y)


def forward(cache: SeqCache, start: int, k: mx.array, v: mx.array, chunk: int | None = None):
    """Serve every layer with the same K/V from `start`, in steps of `chunk` tokens; the last specs."""
    n = k.shape[2]
    chunk = chunk or n
    for s in range(0, n, chunk):
        specs = [
            step(cache, start + s, k[:, :, s : s + chunk], v[:, :, s : s + chunk], layer)
            for layer in range(cache.n_layers)
        ]
    return specs


def wrapped_cache() -> SeqCache:
    """flat + ring(4), max_write=2 (5 ring slots), capacity 12, at length 10: the ring
    has wrapped and holds positions 5..9, so steps may start in [8, 10]."""
    cache = make_cache(windows=(0, 4), capacity=12, max_write=2)
    k, v = kv(10)
    forward(cache, 0, k, v, chunk=2)
    assert (cache.as_control().length, cache.book.floor) == (10, 8)
    return cache


def one(n=1, seed=9, heads=H, dim=D, dtype=mx.float32):
    """`n` random tokens `[1, heads, n, dim]` for a single step."""
    rng = np.random.default_rng(seed)
    return mx.array(rng.normal(size=(1, heads, n, dim)).astype(np.float32)).astype(dtype)
