"""The MLX face: scatter, read window, explicit mask, pools."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvlayout import CacheConfig, LayerConfig, LayerPolicy, MaskKind
from kvlayout.errors import StepError
from kvlayout.faces import BatchControl, CellStepper, CellView, KVCache
from kvlayout.registry import make_plugin_manager
from kvlayout_cell.cache import CellCache
from tests.cell.support import snapshot

H, D = 2, 4


def cache(capacity=16, layers=None, n_layers=2, **kw) -> CellCache:
    layers = layers or [LayerConfig(H, D)]
    config = CacheConfig(
        capacity=capacity, n_layers=n_layers, layers=layers, kv_dtype=kw.pop("kv_dtype", "float32"), **kw
    )
    return CellCache(config, make_plugin_manager())


def kv(T, seed=0, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    k = mx.array(rng.normal(size=(1, H, T, D)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.normal(size=(1, H, T, D)).astype(np.float32)).astype(dtype)
    return k, v


def serve(c, seq_ids, positions, seed=0):
    """Declare and serve every layer; the specs, one per layer."""
    bc = c.as_batch_control()
    assert bc.declare_step(seq_ids)
    k, v = kv(len(positions), seed)
    return [c.update_and_fetch(layer, positions, k, v) for layer in range(c.n_layers)]


def test_the_cache_shows_the_batch_and_stepper_faces_only():
    c = cache()
    assert c.as_control() is None and isinstance(c, KVCache)
    assert not isinstance(c, BatchControl)  # the verbs are the face's alone, as SeqCache's are its control's
    bc, cs = c.as_batch_control(), c.as_cell_stepper()
    assert bc is c.as_batch_control() and cs is c.as_cell_stepper()  # one face object each, per cache
    assert isinstance(bc, BatchControl) and isinstance(cs, CellStepper)
    public = lambda face: sorted(n for n in dir(face) if not n.startswith("_"))  # noqa: E731
    assert public(bc) == ["can_extend", "capacity", "cells_by_window", "clear", "declare_step", "free_cells",
                          "max_seqs", "next_pos", "seq_clone", "seq_floor", "seq_len", "seq_new", "seq_pin", "seq_rm",
                          "used_end"]  # no occupy, restore, release, retire
    assert public(cs) == ["place_step"]
    view = c.as_cell_view()
    assert isinstance(view, CellView) and public(view) == ["capacity", "cell_owners", "max_seqs"]


def test_the_cell_view_shows_each_cell_s_owners_as_the_verbs_left_them():
    c = cache()
    bc, cs = c.as_batch_control(), c.as_cell_stepper()
    a, b = bc.seq_new(), bc.seq_new()
    assert bc.declare_step([a, a, b])
    for layer in (0, 1):
        cs.place_step(layer, [0, 1, 0])
    fork = bc.seq_clone(a, upto=1)  # shares a's position 0 only
    cells, positions, owners = c.as_cell_view().cell_owners()
    assert cells.tolist() == [0, 1, 2] and positions.tolist() == [0, 1, 0]
    assert [sorted(map(int, row.nonzero()[0])) for row in owners] == [sorted([a, fork]), [a], [b]]
    assert owners.shape == (3, bc.max_seqs)
    bc.seq_rm(a)
    cells, _, owners = c.as_cell_view().cell_owners()
    assert cells.tolist() == [0, 2] and [list(map(int, row.nonzero()[0])) for row in owners] == [[fork], [b]]


def test_the_cache_is_composed_of_its_stepper_and_table_not_derived_from_them():
    from kvlayout_cell.stepper import Stepper
    from kvlayout_cell.table import CellTable

    c = cache()
    assert not issubclass(type(c), (Stepper, CellTable)) and not issubclass(Stepper, CellTable)
    assert isinstance(c.groups.primary, Stepper) and isinstance(c.groups.primary.table, CellTable)


def test_the_faces_drive_the_cache_they_came_from():
    c = cache()
    bc, cs = c.as_batch_control(), c.as_cell_stepper()
    s = bc.seq_new()
    assert bc.declare_step([s, s])
    assert cs.place_step(0, [0, 1]).cells.tolist() == [0, 1]
    table = c.groups.primary.table  # the cache's own cells
    assert (table.seq_len(s), bc.free_cells, bc.used_end) == (2, 14, 2)
    cs.place_step(1, [0, 1])  # the forward's last layer: a verb may follow
    bc.seq_rm(s)
    assert (table.free_cells, table.used_end, bc.seq_len(s)) == (16, 0, 0)


@pytest.mark.parametrize("path", ["auto", "dense"])
def test_a_prefill_scatters_the_input_and_masks_causally(path):
    c = cache()
    bc = c.as_batch_control()
    c.attention_path = path
    s0 = bc.seq_new()
    assert bc.declare_step([s0] * 4)
    k, v = kv(4)
    spec = c.update_and_fetch(0, [0, 1, 2, 3], k, v)
    assert spec.keys.shape == (1, H, 4, D)
    assert np.array_equal(np.array(spec.keys), np.array(k))
    assert np.array_equal(np.array(spec.values), np.array(v))
    if path == "auto":  # one sequence, its cells in position order: MLX's (lower-right) causal mask
        assert spec.mask_kind is MaskKind.CAUSAL and spec.mask is None
        return
    assert spec.mask_kind is MaskKind.EXPLICIT
    assert spec.mask.dtype == mx.bool_ and spec.mask.shape == (1, 1, 4, 4)
    assert np.array_equal(np.array(spec.mask)[0, 0], np.tril(np.ones((4, 4), dtype=bool)))


def test_a_freed_cell_refills_below_a_live_one():
    c = cache(initial_capacity=2)
    bc = c.as_batch_control()
    a, b = bc.seq_new(), bc.seq_new()
    serve(c, [a] * 3, [0, 1, 2])
    serve(c, [b], [0], seed=1)
    bc.seq_rm(a)
    d = bc.seq_new()  # new: nothing to continue, and the table is smaller than a page: the lowest free cell
    assert bc.declare_step([d])
    k, v = kv(1, seed=2)
    spec = c.update_and_fetch(0, [0], k, v)
    assert c.as_cell_stepper().place_step(1, [0]).cells.tolist() == [0]
    assert spec.keys.shape[2] == 4
    assert np.array(spec.mask)[0, 0, 0].tolist() == [True, False, False, False]
    assert np.array_equal(np.array(spec.keys)[:, :, 0], np.array(k)[:, :, 0])
    assert np.array_equal(np.array(spec.keys)[:, :, 3], np.array(kv(1, seed=1)[0])[:, :, 0])


def test_a_windowed_layer_hides_older_cells_while_a_flat_one_does_not():
    c = cache(layers=[LayerConfig(H, D, LayerPolicy("ring", 2)), LayerConfig(H, D)])
    bc = c.as_batch_control()
    s0 = bc.seq_new()
    serve(c, [s0] * 3, [0, 1, 2])
    ring, flat = serve(c, [s0], [3])
    assert np.array(ring.mask)[0, 0, 0].tolist() == [False, False, True, True]
    # The flat layer's lone token sees all four cells: no mask at all, over all four.
    assert flat.mask_kind is MaskKind.NONE and flat.mask is None and flat.keys.shape[2] == 4
    assert ring.keys.shape == flat.keys.shape == (1, H, 4, D)  # every pool spans the whole table


def test_pools_grow_from_two_slots_and_keep_earlier_cells():
    c = cache(capacity=16, initial_capacity=2, n_layers=1)
    bc = c.as_batch_control()
    s0 = bc.seq_new()
    assert c.key_pools[0].slots == 2 and c.key_pools[0].max_slots == 16
    k0, v0 = kv(2, seed=0)
    assert bc.declare_step([s0] * 2)
    c.update_and_fetch(0, [0, 1], k0, v0)
    k1, v1 = kv(3, seed=1)
    assert bc.declare_step([s0] * 3)
    spec = c.update_and_fetch(0, [2, 3, 4], k1, v1)
    assert c.key_pools[0].slots == 8
    assert np.array_equal(np.array(spec.keys), np.concatenate([np.array(k0), np.array(k1)], axis=2))
    assert np.array_equal(np.array(spec.values), np.concatenate([np.array(v0), np.array(v1)], axis=2))


def test_pools_past_one_page_hold_whole_pages_of_256_slots_but_only_capacity_cells():
    c = cache(capacity=1000, initial_capacity=300)
    bc = c.as_batch_control()
    assert (c.key_pools[0].slots, c.key_pools[0].max_slots) == (512, 1024)  # 300 -> 512, 1000 -> 1024
    assert bc.free_cells == 1000 and bc.capacity == 1000
    s0 = bc.seq_new()
    assert bc.declare_step([s0] * 1000) and not bc.declare_step([s0] * 1001)
    small = cache(capacity=100, initial_capacity=300)
    assert (small.key_pools[0].slots, small.key_pools[0].max_slots) == (100, 100)  # one page or less: as asked


def test_fp32_input_is_stored_as_bf16():
    c = cache(kv_dtype="bfloat16")
    bc = c.as_batch_control()
    s0 = bc.seq_new()
    assert bc.declare_step([s0] * 2)
    k, v = kv(2)
    spec = c.update_and_fetch(0, [0, 1], k, v)
    assert spec.keys.dtype == mx.bfloat16 and spec.values.dtype == mx.bfloat16
    assert np.allclose(np.array(spec.keys.astype(mx.float32)), np.array(k), rtol=1e-2, atol=1e-2)


def test_a_full_table_refuses_the_declaration_and_stays_full():
    c = cache(capacity=4)
    bc = c.as_batch_control()
    s0 = bc.seq_new()
    serve(c, [s0] * 4, [0, 1, 2, 3])
    before = snapshot(c)
    assert bc.free_cells == 0 and not bc.can_extend(1)
    assert bc.declare_step([s0]) is False
    assert bc.free_cells == 0 and snapshot(c) == before


def test_a_miscounted_call_claims_no_cell_and_the_declaration_stands():
    c = cache()
    bc = c.as_batch_control()
    s0 = bc.seq_new()
    assert bc.declare_step([s0] * 2)
    k, v = kv(2)
    before = snapshot(c)
    with pytest.raises(StepError, match=r"3 position\(s\) for k/v of 2 token\(s\)"):
        c.update_and_fetch(0, [0, 1, 2], k, v)
    assert snapshot(c) == before
    spec = c.update_and_fetch(0, mx.array([0, 1]), k, v)
    assert spec.keys.shape[2] == 2


@pytest.mark.parametrize("shape", [(1, H + 1, 2, D), (1, H, 2, D + 1), (2, H, 2, D), (H, 2, D)])
def test_keys_of_the_wrong_shape_are_refused_before_placing(shape):
    c = cache()
    bc = c.as_batch_control()
    s0 = bc.seq_new()
    assert bc.declare_step([s0] * 2)
    before = snapshot(c)
    with pytest.raises(StepError, match=rf"expected an mlx array \[1, {H}, T, {D}\]"):
        c.update_and_fetch(0, [0, 1], mx.zeros(shape), mx.zeros(shape))
    assert snapshot(c) == before


def test_layers_of_one_window_share_one_mask_array():
    c = cache(n_layers=3)
    bc = c.as_batch_control()
    s0 = bc.seq_new()
    specs = serve(c, [s0] * 3, [0, 1, 2])
    assert specs[0].mask is specs[1].mask is specs[2].mask


def test_clear_frees_every_cell_and_id():
    c = cache()
    bc = c.as_batch_control()
    s0 = bc.seq_new()
    serve(c, [s0] * 3, [0, 1, 2])
    bc.clear()
    assert (bc.free_cells, bc.used_end, bc.seq_new()) == (16, 0, 0)
    s1 = bc.seq_new()
    spec = serve(c, [s0, s1], [0, 0])[0]  # nothing of before the clear is seen
    assert np.array(spec.mask)[0, 0].tolist() == [[True, False], [False, True]]
