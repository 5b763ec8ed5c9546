"""Saving and restoring the cell layout: the whole cache, and one sequence at a time."""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest

import kvlayout
from kvlayout import CacheConfig, LayerConfig, LayerPolicy, SequenceError, StateError, StepError, persist
from kvlayout.faces import Persistent
from kvlayout.hookspecs import hookimpl
from kvlayout.mlx.tensors import to_raw
from kvlayout.registry import make_plugin_manager
from kvlayout_cell.cache import CellCache
from tests.cell.support import snapshot
from tests.helpers import TinyStack

WINDOWS = (0, 3, 0)


def config(kv_dtype="float32", capacity=64, max_seqs=8, windows=WINDOWS, head_dim=8) -> CacheConfig:
    layers = [LayerConfig(2, head_dim, LayerPolicy("ring", w) if w else LayerPolicy()) for w in windows]
    return CacheConfig(
        capacity=capacity,
        n_layers=len(windows),
        layers=layers,
        kv_dtype=kv_dtype,
        initial_capacity=4,
        max_seqs=max_seqs,
    )


def table_state(cache) -> tuple:
    """The counts, and each layer group's table (cells, positions, owners, live ids, free list, cuts)."""
    bc = cache.as_batch_control()
    groups = []
    for st in cache.groups.steppers:
        cells, pos, owners = st.table.occupied()
        cuts = None if st.keeper is None else st.keeper.cut.tolist()
        groups.append((cells.tolist(), pos.tolist(), owners.tolist(), st.table.live_ids().tolist(),
                       st.table.free_list().tolist(), cuts))
    floors = [bc.seq_floor(s) for s in cache.groups.primary.table.live_ids().tolist()]
    return snapshot(cache), groups, floors


def kv_bits(cache) -> list[np.ndarray]:
    """Every layer's K and V at its layer group's occupied cells, as raw bits."""
    out = []
    for pools in (cache.key_pools, cache.value_pools):
        for layer, pool in enumerate(pools):
            table = cache.groups.stepper_of(layer).table
            cells, _, _ = table.occupied()
            raw = to_raw(pool.read(0, table.used_end)[:, :, mx.array(cells.astype(np.int32)), :])
            out.append(np.frombuffer(bytes(raw.data), dtype=np.uint8))
    return out


class Run:
    """A TinyStack driving a CellCache: sequences decode one token per step."""

    def __init__(self, cache, stack=None):
        self.cache, self.stack = cache, stack or TinyStack(n_layers=3, n_kv_heads=2, head_dim=8)

    def step(self, tokens: list[tuple[int, int]]) -> np.ndarray:
        """One forward of `(seq, input seed)` tokens at each sequence's next position."""
        seqs = [s for s, _ in tokens]
        positions, nxt = [], {}
        for s in seqs:
            nxt.setdefault(s, self.cache.as_batch_control().next_pos(s))
            positions.append(nxt[s])
            nxt[s] += 1
        x = mx.concatenate([self.stack.tokens(1, seed=seed) for _, seed in tokens], axis=1)
        assert self.cache.as_batch_control().declare_step(seqs)
        return np.array(self.stack.forward_cached(self.cache, x.astype(mx.float32), positions))


def busy_cache(kv_dtype="float32") -> CellCache:
    """Three sequences, one a fork sharing a prefix, and a freed hole below used_end."""
    cache = CellCache(config(kv_dtype), pm=make_plugin_manager())
    bc = cache.as_batch_control()
    run = Run(cache)
    a, b = bc.seq_new(), bc.seq_new()
    run.step([(a, i) for i in range(6)] + [(b, 10 + i) for i in range(3)])
    c = bc.seq_clone(a, upto=4)
    run.step([(a, 20), (b, 21), (c, 22)])
    bc.seq_rm(b, 1, 2)  # a hole
    return cache


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "float32"])
def test_a_saved_cache_loads_back_bit_for_bit(tmp_path, kv_dtype):
    cache = busy_cache(kv_dtype)
    path = cache.save(tmp_path / "cell.safetensors")
    back = kvlayout.load(path)
    assert isinstance(back, CellCache) and back.config == cache.config
    assert table_state(back) == table_state(cache)
    for got, want in zip(kv_bits(back), kv_bits(cache), strict=True):
        np.testing.assert_array_equal(got, want)
    dtype_tags = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
    assert persist.read_state(path).tensors["k.0"].dtype == dtype_tags[kv_dtype]


def test_the_file_keeps_only_the_occupied_cells(tmp_path):
    cache = busy_cache()
    f = persist.read_state(cache.save(tmp_path / "cell.safetensors"))
    used = cache.as_batch_control().cells_by_window()  # window -> cells its layer group holds
    assert used[3] < used[0]  # the ring's group retired what its window no longer reads
    for layer, window in enumerate(WINDOWS):  # each layer keeps its own group's occupied cells
        assert f.tensors[f"k.{layer}"].shape == (1, 2, used[window], 8)
    assert f.tensors["cells"].shape == (used[0],)
    assert f.tensors["cells.g1"].shape == (used[3],)


def test_the_cell_cache_has_the_persistent_face():
    assert isinstance(busy_cache(), Persistent)


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_a_restored_cache_generates_exactly_as_the_original_goes_on(tmp_path, kv_dtype):
    cache = busy_cache(kv_dtype)
    back = kvlayout.load(cache.save(tmp_path / "cell.safetensors"))
    live = cache.groups.primary.table.live_ids().tolist()
    for i in range(4):
        tokens = [(s, 100 + 10 * i + s) for s in live]
        np.testing.assert_array_equal(Run(back).step(tokens), Run(cache).step(tokens))
    assert table_state(back) == table_state(cache)


def test_an_empty_cache_round_trips(tmp_path):
    cache = CellCache(config(), pm=make_plugin_manager())
    bc = cache.as_batch_control()
    s = bc.seq_new()  # live, owning nothing
    back = kvlayout.load(cache.save(tmp_path / "e.safetensors"))
    assert table_state(back) == table_state(cache)
    assert back.groups.primary.table.live_ids().tolist() == [s]


def test_saving_in_the_middle_of_a_forward_is_refused(tmp_path):
    cache = CellCache(config(), pm=make_plugin_manager())
    bc = cache.as_batch_control()
    s = bc.seq_new()
    assert bc.declare_step([s])
    k = mx.zeros((1, 2, 1, 8))
    cache.update_and_fetch(0, [0], k, k)
    with pytest.raises(StepError, match=r"save during a forward: layer\(s\) \[[12, ]+\] of the placed step were not"):
        cache.save(tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    assert cache.abort_step()
    cache.save(tmp_path / "x.safetensors")  # fine once aborted


def test_saving_in_the_middle_of_a_forward_names_every_layer_not_served(tmp_path):
    cache = CellCache(config(), pm=make_plugin_manager())
    s = cache.as_batch_control().seq_new()
    assert cache.as_batch_control().declare_step([s])
    k = mx.zeros((1, 2, 1, 8))
    cache.update_and_fetch(0, [0], k, k)
    with pytest.raises(StepError, match=r"layer\(s\) \[1, 2\] of the placed step were not served"):
        cache.save(tmp_path / "x.safetensors")


def save_bad(tmp_path, cache, state: dict, tensors: dict) -> None:
    """A cache file of `cache`'s layout and config with a damaged `state` or `tensors`, at bad.safetensors."""
    persist.save_state(tmp_path / "bad.safetensors", layout="mlx:cell", content="cache", config=cache.config,
                       state=state, tensors=tensors)


def test_a_file_whose_table_breaks_an_invariant_is_refused(tmp_path):
    cache = busy_cache()
    good = persist.read_state(cache.save(tmp_path / "good.safetensors"))
    owners = persist.numpy_of(good.tensors["owners"]).copy()
    owners[0, 0] |= np.uint64(1) << np.uint64(7)  # sequence 7 owns a cell but is not live
    tensors = {**good.tensors, "owners": persist.raw_numpy(owners)}
    save_bad(tmp_path, cache, good.state, tensors)
    with pytest.raises(StateError, match="sequence 7 owns cells but is not live"):
        kvlayout.load(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("live", [None, "0,1", [0, True], [[0, 1]], [0.0, 1.0]])
def test_a_file_whose_live_ids_are_not_a_list_of_integers_is_refused_by_name(tmp_path, live):
    cache = busy_cache()
    good = persist.read_state(cache.save(tmp_path / "good.safetensors"))
    save_bad(tmp_path, cache, {**good.state, "live": live}, good.tensors)
    with pytest.raises(StateError, match=r"bad\.safetensors: state\.live"):
        kvlayout.load(tmp_path / "bad.safetensors")


def test_a_file_with_a_wrong_tensor_shape_is_refused(tmp_path):
    cache = busy_cache()
    bc = cache.as_batch_control()
    good = persist.read_state(cache.save(tmp_path / "good.safetensors"))
    tensors = dict(good.tensors)
    tensors["k.2"] = persist.raw_numpy(np.zeros((1, 2, 1, 8), dtype=np.float32))
    save_bad(tmp_path, cache, good.state, tensors)
    n = bc.capacity - bc.free_cells
    with pytest.raises(StateError, match=rf"tensor 'k.2' is F32\[1, 2, 1, 8\], expected F32\[1, 2, {n}, 8\]"):
        kvlayout.load(tmp_path / "bad.safetensors")


# -- one sequence: save_seq / load_seq ----------------------------------------------------


def test_a_sequence_moves_to_another_cache_with_fresh_cells_and_a_fresh_id(tmp_path):
    src = busy_cache()
    src_bc = src.as_batch_control()
    path = src.save_seq(2, tmp_path / "seq.safetensors")  # the fork: its cells are shared in src
    dst = CellCache(config(capacity=32, max_seqs=4), pm=make_plugin_manager())
    dst_bc = dst.as_batch_control()
    Run(dst).step([(dst_bc.seq_new(), 1), (dst_bc.seq_new(), 2)])
    before_free = dst_bc.free_cells
    sid = dst.load_seq(path)
    assert sid == 2
    assert (dst_bc.seq_len(sid), dst_bc.next_pos(sid)) == (src_bc.seq_len(2), src_bc.next_pos(2))
    assert dst_bc.free_cells == before_free - src_bc.seq_len(2)
    assert dst_bc.seq_floor(sid) == src_bc.seq_floor(2)  # where its window layers cut it, kept
    for layer in range(len(WINDOWS)):  # each layer's K/V at its own layer group's cells
        dst_table, src_table = dst.groups.stepper_of(layer).table, src.groups.stepper_of(layer).table
        cells, pos = dst_table.seq_cells(sid)
        src_cells, src_pos = src_table.seq_cells(2)
        assert pos.tolist() == src_pos.tolist()
        for p_dst, p_src in ((dst.key_pools[layer], src.key_pools[layer]),
                             (dst.value_pools[layer], src.value_pools[layer])):
            got = np.array(p_dst.read(0, dst_table.used_end)[:, :, mx.array(cells.astype(np.int32)), :])
            want = np.array(p_src.read(0, src_table.used_end)[:, :, mx.array(src_cells.astype(np.int32)), :])
            np.testing.assert_array_equal(got, want)
    # It goes on as it would have in the source cache (other sequences only add masked columns).
    for i in range(3):
        got = Run(dst).step([(sid, 50 + i)])
        want = Run(src).step([(2, 50 + i)])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class HighestFirst:
    """A placement policy (highest free cells first) that also records every placement it hears of."""

    def __init__(self):
        self.placed = []

    @hookimpl
    def kvlayout_choose_cells(self, free, count):
        return free[::-1][:count]

    @hookimpl
    def kvlayout_step_placed(self, step, window):
        self.placed.append((window, step.cells.tolist()))


def test_a_loaded_sequence_goes_through_placement_and_its_observers_hear_of_it(tmp_path):
    path = busy_cache().save_seq(0, tmp_path / "seq.safetensors")  # 7 cells, positions 0..6
    pm = make_plugin_manager()
    policy = HighestFirst()
    pm.register(policy)
    dst = CellCache(config(capacity=16), pm=pm)
    sid = dst.load_seq(path)
    cells, pos = dst.groups.primary.table.seq_cells(sid)
    assert cells.tolist() == list(range(15, 8, -1)) and pos.tolist() == list(range(7))  # the policy's cells
    # The ring's group held only 3..6 (retired to its last 3 at the 2nd declaration, then 6 placed).
    ring_cells, ring_pos = dst.groups.stepper_of(1).table.seq_cells(sid)
    assert ring_cells.tolist() == list(range(15, 11, -1)) and ring_pos.tolist() == [3, 4, 5, 6]
    assert policy.placed == [(0, cells.tolist()), (3, ring_cells.tolist())]  # once per window (0 and 3)
    assert not dst.abort_step()  # the placement is closed: nothing to abort
    assert dst.groups.unserved_layers() == []  # and no layer left to serve: the cache saves at once
    dst.save(tmp_path / "whole.safetensors")


class BadPolicy:
    @hookimpl(tryfirst=True)
    def kvlayout_choose_cells(self, free, count):
        return [0] * count  # repeats a cell


def test_load_seq_refuses_a_bad_placement_answer_and_changes_nothing(tmp_path):
    path = busy_cache().save_seq(0, tmp_path / "seq.safetensors")
    pm = make_plugin_manager()
    dst = CellCache(config(), pm=pm)
    dst_bc = dst.as_batch_control()
    Run(dst).step([(dst_bc.seq_new(), 1), (dst_bc.seq_new(), 2)])
    before = table_state(dst)
    pm.register(BadPolicy())
    with pytest.raises(StepError, match="kvlayout_choose_cells answered"):
        dst.load_seq(path)
    assert table_state(dst) == before


def test_load_seq_answers_none_and_changes_nothing_when_cells_or_ids_are_short(tmp_path):
    src = busy_cache()
    path = src.save_seq(0, tmp_path / "seq.safetensors")  # 7 cells
    full = CellCache(config(capacity=8), pm=make_plugin_manager())
    full_bc = full.as_batch_control()
    Run(full).step([(full_bc.seq_new(), i) for i in range(3)])  # 5 cells left
    before = table_state(full)
    assert full.load_seq(path) is None
    assert table_state(full) == before
    no_ids = CellCache(config(max_seqs=1), pm=make_plugin_manager())
    no_ids_bc = no_ids.as_batch_control()
    no_ids_bc.seq_new()
    before = table_state(no_ids)
    assert no_ids.load_seq(path) is None
    assert table_state(no_ids) == before


def test_load_seq_refuses_a_cache_with_other_layers_or_dtype(tmp_path):
    path = busy_cache().save_seq(1, tmp_path / "seq.safetensors")
    for other in (config(head_dim=4), config(kv_dtype="float16"), config(windows=(0, 4, 0)), config(windows=(0, 3))):
        cache = CellCache(other, pm=make_plugin_manager())
        with pytest.raises(StateError, match="cannot take"):
            cache.load_seq(path)
        assert cache.groups.primary.table.live_ids().size == 0


def test_load_seq_refuses_a_whole_cache_file_and_load_refuses_a_sequence_file(tmp_path):
    cache = busy_cache()
    whole = cache.save(tmp_path / "whole.safetensors")
    one = cache.save_seq(0, tmp_path / "one.safetensors")
    with pytest.raises(StateError, match="holds a cache, expected a sequence"):
        cache.load_seq(whole)
    with pytest.raises(StateError, match="holds one sequence"):
        kvlayout.load(one)


def test_load_seq_refuses_a_seq_layout_file(tmp_path):
    seq = kvlayout.build("mlx", "seq", config())
    path = seq.save(tmp_path / "seq-layout.safetensors")
    with pytest.raises(StateError, match="saved by layout mlx:seq, expected mlx:cell"):
        busy_cache().load_seq(path)


def test_save_seq_of_an_id_not_live_is_refused(tmp_path):
    with pytest.raises(SequenceError, match="seq_id=5"):
        busy_cache().save_seq(5, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_an_empty_sequence_round_trips(tmp_path):
    cache = CellCache(config(), pm=make_plugin_manager())
    bc = cache.as_batch_control()
    s = bc.seq_new()
    path = cache.save_seq(s, tmp_path / "e.safetensors")
    other = CellCache(attrs.evolve(config(), capacity=8), pm=make_plugin_manager())
    other_bc = other.as_batch_control()
    sid = other.load_seq(path)
    assert sid == 0 and other_bc.seq_len(sid) == 0 and other.groups.primary.table.live_ids().tolist() == [0]


def test_load_seq_ends_an_open_step(tmp_path):
    cache = busy_cache()
    path = cache.save_seq(0, tmp_path / "s.safetensors")
    Run(cache).step([(0, 1)])
    assert cache.load_seq(path) is not None
    assert cache.abort_step() is False
