"""abort_step on the cell layout: a step placed and then abandoned leaves no trace in the table."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvlayout import CacheConfig, LayerConfig, LayerPolicy, StepError
from kvlayout.faces import StepAbort
from kvlayout.registry import make_plugin_manager
from kvlayout_cell.cache import CellCache
from tests.cell.support import fill, snapshot, step, stepper
from tests.helpers import TinyStack


def state(table) -> tuple:
    """Everything the table holds: observable counts plus the cells, owners, live ids and free list."""
    cells, pos, owners = table.table.occupied()
    return (
        snapshot(table),
        cells.tolist(),
        pos.tolist(),
        owners.tolist(),
        table.table.live_ids().tolist(),
        table.table.free_list().tolist(),
    )


def test_abort_after_the_first_layer_releases_the_step_and_restores_every_count():
    t = stepper(capacity=16, windows=(0, 4, 0))
    a, b = t.seq_new(), t.seq_new()
    fill(t, a, range(5))
    fill(t, b, range(3))
    before = state(t)
    assert t.declare_step([a, a, b])
    t.place_step(0, [5, 6, 3])  # layer 0 only: the forward fails in layer 1
    assert t.table.seq_len(a) == 7 and t.table.free_cells == 16 - 11
    assert t.abort_step() is True
    assert state(t) == before


def test_abort_after_every_layer_was_served_still_undoes_the_step():
    t = stepper(capacity=12)
    a = t.seq_new()
    fill(t, a, range(4))
    before = state(t)
    step(t, [(a, 4), (a, 5)])
    assert t.abort_step()
    assert state(t) == before


def test_abort_restores_a_hole_below_used_end_and_a_shared_prefix():
    t = stepper(capacity=16)
    a = t.seq_new()
    fill(t, a, range(6))
    b = t.seq_clone(a, upto=4)  # shares cells 0..3
    t.seq_rm(a, 4, 5)  # a hole at cell 4, below used_end
    t.table.free_list()  # the lazily rebuilt free list exists before the step
    before = state(t)
    step(t, [(a, 6), (b, 4), (b, 5)])  # refills the hole, then grows the table
    assert t.table.used_end > before[0][1]
    assert t.abort_step()
    assert state(t) == before
    assert t.table.free_list().tolist() == [4, *range(6, 16)]


def test_after_an_abort_the_next_step_lands_where_it_would_have():
    twin, t = stepper(capacity=16), stepper(capacity=16)
    for table in (twin, t):
        s = table.seq_new()
        fill(table, s, range(3))
    step(t, [(0, 3), (0, 4)])
    assert t.abort_step()
    a = step(t, [(0, 3)])
    b = step(twin, [(0, 3)])
    assert a.cells.tolist() == b.cells.tolist()
    np.testing.assert_array_equal(a.mask, b.mask)
    assert state(t) == state(twin)


def test_with_no_open_step_abort_changes_nothing_and_answers_false():
    t = stepper()
    assert t.abort_step() is False
    a = t.seq_new()
    fill(t, a, range(3))
    t.seq_new()  # a verb ends the placed step
    before = state(t)
    assert t.abort_step() is False
    assert state(t) == before


def test_a_new_declaration_ends_the_step_abort_can_undo():
    t = stepper()
    a = t.seq_new()
    fill(t, a, range(3))
    assert t.declare_step([a])
    before = state(t)
    assert t.abort_step() is False  # declared, not placed: nothing to undo
    assert state(t) == before
    t.place_step(0, [3])  # the declaration still stands
    assert t.abort_step() is True


def test_after_an_abort_no_declaration_stands():
    t = stepper()
    a = t.seq_new()
    assert t.declare_step([a, a])
    t.place_step(0, [0, 1])
    assert t.abort_step()
    with pytest.raises(StepError, match="no step declared"):
        t.place_step(0, [0, 1])
    assert t.abort_step() is False  # a second abort has nothing left


def test_a_refused_placement_opens_no_step():
    t = stepper()
    a = t.seq_new()
    fill(t, a, range(3))
    assert t.declare_step([a])
    with pytest.raises(StepError):
        t.place_step(0, [2])  # not newer than what a holds
    before = state(t)
    assert t.abort_step() is False
    assert state(t) == before


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_with_random_aborts_match_a_table_that_never_saw_them(seed):
    rng = np.random.default_rng(seed)
    windows = (0, 3)
    t, twin = stepper(capacity=40, windows=windows, max_seqs=4), stepper(capacity=40, windows=windows, max_seqs=4)
    for _ in range(60):
        live = t.table.live_ids().tolist()
        r = rng.random()
        if r < 0.15 or not live:
            assert t.seq_new() == twin.seq_new()
        elif r < 0.25:
            s = int(rng.choice(live))
            p0 = int(rng.integers(0, max(t.table.next_pos(s), 1)))
            t.seq_rm(s, p0)
            twin.seq_rm(s, p0)
        else:
            seqs = [int(s) for s in rng.choice(live, size=int(rng.integers(1, 4)))]
            nxt = {s: t.table.next_pos(s) for s in seqs}
            tokens = []
            for s in seqs:
                tokens.append((s, nxt[s]))
                nxt[s] += 1
            if not t.table.can_extend(len(tokens)):
                continue
            if rng.random() < 0.4:  # this forward fails after some layers
                assert t.declare_step([s for s, _ in tokens])
                for layer in range(int(rng.integers(1, len(windows) + 1))):
                    t.place_step(layer, [p for _, p in tokens])
                assert t.abort_step()
            else:
                step(t, tokens)
                step(twin, tokens)
        assert state(t) == state(twin)


# -- the MLX face: K/V of an aborted step never reach a later step's output ----------------


def cell_cache(windows=(0, 0, 0), capacity=64, kv_dtype="float32") -> CellCache:
    layers = [LayerConfig(2, 8, LayerPolicy("ring", w) if w else LayerPolicy()) for w in windows]
    config = CacheConfig(capacity=capacity, n_layers=len(windows), layers=layers, kv_dtype=kv_dtype, initial_capacity=8)
    return CellCache(config, pm=make_plugin_manager())


class Boom(Exception):
    pass


def forward_failing_at(stack: TinyStack, cache, x, positions, fail_layer: int):
    """`stack.forward_cached`, raising in layer `fail_layer` after the ones below it wrote K/V."""
    from kvlayout.mlx import attend

    for layer, p in enumerate(stack.layers):
        if layer == fail_layer:
            raise Boom(f"layer {layer}")
        q, k, v = stack.project_qkv(p, x)
        spec = cache.update_and_fetch(layer, list(positions), k, v)
        x = stack.project_out(p, x, attend(q, spec, stack.scale))
        mx.eval(x)
    return x


def test_the_cell_cache_implements_the_step_abort_face():
    assert isinstance(cell_cache(), StepAbort)


@pytest.mark.parametrize("fail_layer", [1, 2])
@pytest.mark.parametrize("windows", [(0, 0, 0), (3, 0, 3)])
def test_sequences_continue_exactly_as_without_the_failed_step(fail_layer, windows):
    stack = TinyStack(n_layers=3, n_kv_heads=2, head_dim=8)
    failed, clean = cell_cache(windows), cell_cache(windows)
    xa, xb = stack.tokens(8, seed=1), stack.tokens(8, seed=2)
    outs = {}
    for name, cache in (("failed", failed), ("clean", clean)):
        bc = cache.as_batch_control()
        a, b = bc.seq_new(), bc.seq_new()
        assert bc.declare_step([a] * 5 + [b] * 4)
        x = mx.concatenate([xa[:, :5], xb[:, :4]], axis=1)
        stack.forward_cached(cache, x, [*range(5), *range(4)])
        if name == "failed":
            assert bc.declare_step([a, b])
            with pytest.raises(Boom):
                forward_failing_at(stack, cache, mx.concatenate([xa[:, 5:6], xb[:, 4:5]], axis=1), [5, 4], fail_layer)
            assert cache.abort_step()
        steps = []
        for i in range(3):  # three more decode steps of both sequences
            assert bc.declare_step([a, b])
            x = mx.concatenate([xa[:, 5 + i : 6 + i], xb[:, 4 + i : 5 + i]], axis=1)
            steps.append(np.array(stack.forward_cached(cache, x, [5 + i, 4 + i])))
        outs[name] = steps
    for got, want in zip(outs["failed"], outs["clean"], strict=True):
        np.testing.assert_array_equal(got, want)  # bit for bit


def test_a_verb_between_layers_leaves_no_half_written_step_for_the_next_step_to_read(tmp_path):
    # Was: seq_new() between layers ended the step, layer 1 was refused, abort_step() said False,
    # save() wrote the cache, and every later step read zeros for position 0 at layer 1.
    cache = cell_cache((0, 0))
    bc = cache.as_batch_control()
    rng = np.random.default_rng(0)
    k = [mx.array(rng.normal(size=(1, 2, 1, 8)).astype(np.float32)) for _ in range(4)]
    a = bc.seq_new()
    assert bc.declare_step([a])
    cache.update_and_fetch(0, [0], k[0], k[0])
    with pytest.raises(StepError, match=r"seq_new during a forward: layer\(s\) \[1\]"):
        bc.seq_new()
    with pytest.raises(StepError, match=r"save during a forward: layer\(s\) \[1\]"):
        cache.save(tmp_path / "cache.kv")
    assert cache.groups.unserved_layers() == [1]  # still open: abort_step() would take it back
    cache.update_and_fetch(1, [0], k[1], k[1])  # the forward goes on
    assert bc.seq_new() == 1
    cache.save(tmp_path / "cache.kv")
    assert bc.declare_step([a])
    cache.update_and_fetch(0, [1], k[2], k[2])
    spec = cache.update_and_fetch(1, [1], k[3], k[3])
    np.testing.assert_array_equal(np.array(spec.keys), np.concatenate([np.array(k[1]), np.array(k[3])], axis=2))
