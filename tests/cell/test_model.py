"""Model-level: batched, forked and re-placed runs equal each sequence's cache-free forward.

Storage is float32, so every output must match `forward_reference` over the
sequence alone to 1e-4, whatever else shares the step and whatever cells the
tokens land in.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvlayout import CacheConfig, LayerConfig, LayerPolicy, hookimpl
from kvlayout.registry import make_plugin_manager
from kvlayout_cell.cache import CellCache
from kvlayout_cell.plugin import LowestFree
from tests.helpers import TinyStack

STACK = TinyStack(n_layers=3)


def make_cache(pm=None, windows=(0, 0, 0), capacity=64) -> CellCache:
    layers = [
        LayerConfig(STACK.n_kv_heads, STACK.head_dim, LayerPolicy("ring", w) if w else LayerPolicy())
        for w in windows
    ]
    config = CacheConfig(capacity=capacity, n_layers=3, layers=layers, kv_dtype="float32", initial_capacity=8)
    return CellCache(config, make_plugin_manager() if pm is None else pm)


run_step = STACK.forward_parts  # one step over [(seq, x, first_pos), ...]; each part's rows


def solo(x, windows=()):
    return STACK.forward_reference(x, windows)


def close(a, b):
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4, rtol=1e-4)


class HighestFree:
    @hookimpl
    def kvlayout_choose_cells(self, free, count):
        return free[::-1][:count]


class Shuffled:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    @hookimpl
    def kvlayout_choose_cells(self, free, count):
        return self.rng.choice(free, size=count, replace=False)


def managers():
    pms = {"default": make_plugin_manager()}  # the cell plugin's own: pages of their own
    for name, policy in (("lowest-free", LowestFree()), ("highest-free", HighestFree()), ("shuffled", Shuffled(7))):
        pms[name] = make_plugin_manager()
        pms[name].register(policy)
    return pms


@pytest.mark.parametrize("policy", ["default", "lowest-free", "highest-free", "shuffled"])
def test_two_prefills_and_a_batched_decode_equal_each_solo_run(policy):
    cache = make_cache(managers()[policy])
    bc = cache.as_batch_control()
    a, b = STACK.tokens(6, seed=1), STACK.tokens(4, seed=2)
    sa, sb = bc.seq_new(), bc.seq_new()
    out_a, out_b = run_step(cache, [(sa, a[:, :5], 0), (sb, b[:, :3], 0)])
    close(out_a, solo(a[:, :5]))
    close(out_b, solo(b[:, :3]))
    out_b, out_a = run_step(cache, [(sb, b[:, 3:], 3), (sa, a[:, 5:], 5)])
    close(out_a, solo(a)[:, 5:])
    close(out_b, solo(b)[:, 3:])


@pytest.mark.parametrize("policy", ["default", "lowest-free", "shuffled"])
def test_a_fork_continues_its_trunk_exactly(policy):
    cache = make_cache(managers()[policy])
    bc = cache.as_batch_control()
    trunk = STACK.tokens(5, seed=3)
    tail_t, tail_f = STACK.tokens(2, seed=4), STACK.tokens(2, seed=5)
    s = bc.seq_new()
    run_step(cache, [(s, trunk, 0)])
    f = bc.seq_clone(s)
    free = bc.free_cells
    out_t, out_f = run_step(cache, [(s, tail_t, 5), (f, tail_f, 5)])
    assert bc.free_cells == free - 4  # the prefix was shared, not copied
    close(out_t, solo(mx.concatenate([trunk, tail_t], axis=1))[:, 5:])
    close(out_f, solo(mx.concatenate([trunk, tail_f], axis=1))[:, 5:])


def test_a_fork_at_upto_continues_only_the_prefix():
    cache = make_cache()
    bc = cache.as_batch_control()
    trunk, tail = STACK.tokens(5, seed=6), STACK.tokens(3, seed=7)
    s = bc.seq_new()
    run_step(cache, [(s, trunk, 0)])
    f = bc.seq_clone(s, upto=2)
    (out_f,) = run_step(cache, [(f, tail, 2)])
    close(out_f, solo(mx.concatenate([trunk[:, :2], tail], axis=1))[:, 2:])


def test_a_sequence_refilling_freed_cells_below_another_still_matches():
    cache = make_cache(capacity=16)
    bc = cache.as_batch_control()
    a, b, c = STACK.tokens(6, seed=8), STACK.tokens(4, seed=9), STACK.tokens(5, seed=10)
    sa, sb = bc.seq_new(), bc.seq_new()
    run_step(cache, [(sa, a, 0), (sb, b[:, :2], 0)])
    bc.seq_rm(sa)  # cells 0..5 free, b lives in 6..7
    sc = bc.seq_new()
    out_c, out_b = run_step(cache, [(sc, c, 0), (sb, b[:, 2:], 2)])
    close(out_c, solo(c))
    close(out_b, solo(b)[:, 2:])


def test_mixed_windows_match_a_sliding_window_reference():
    windows = (2, 0, 3)
    cache = make_cache(windows=windows)
    bc = cache.as_batch_control()
    a, b = STACK.tokens(7, seed=11), STACK.tokens(5, seed=12)
    sa, sb = bc.seq_new(), bc.seq_new()
    out_a, out_b = run_step(cache, [(sa, a[:, :4], 0), (sb, b[:, :4], 0)])
    close(out_a, solo(a[:, :4], windows))
    for i in range(4, 7):
        parts = [(sa, a[:, i : i + 1], i)] + ([(sb, b[:, i : i + 1], i)] if i < 5 else [])
        outs = run_step(cache, parts)
        close(outs[0], solo(a[:, : i + 1], windows)[:, i:])
        if i < 5:
            close(outs[1], solo(b[:, : i + 1], windows)[:, i:])


@pytest.mark.parametrize("path", ["dense", "grouped", "paged"])
@pytest.mark.parametrize("policy", ["default", "lowest-free", "shuffled"])
def test_every_attention_path_decodes_several_sequences_as_each_solo_run(path, policy):
    # Prompts written in turn, then decodes side by side: under "paged" the groups read pages where
    # they hold half of one and gather the rest; the result is each sequence's cache-free forward.
    windows = (0, 3, 0)
    cache = make_cache(managers()[policy], windows=windows)
    bc = cache.as_batch_control()
    cache.attention_path = path
    xs = [STACK.tokens(9, seed=20 + i) for i in range(3)]
    ids = [bc.seq_new() for _ in xs]
    for s, x in zip(ids, xs):
        run_step(cache, [(s, x[:, :6], 0)])
    for i in range(6, 9):
        outs = run_step(cache, [(s, x[:, i : i + 1], i) for s, x in zip(ids, xs)])
        for out, x in zip(outs, xs):
            close(out, solo(x[:, : i + 1], windows)[:, i:])
