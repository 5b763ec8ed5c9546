"""Quantized cells ("q8"/"q4"): every attention path of the cell layout against numpy over the
dequantized triples, forks sharing packed bytes, and saved files keeping every bit (SeqCache's
too).

The reference keeps its own history: each token's K and V as `mx.quantize` of the float16 input
(what a pool must store), read through the numpy oracle of tests/core/test_quantized_kv.py (never
`mx.dequantize`), and which positions a token sees from its sequence and the layer's window alone.
After every step the cache's pools at each sequence's cells must hold that history bit for bit.
Every cache of a `Trio` gets the very same q/k/v at every layer (the dense path's output carries
the stack on), so their pools hold one set of bits and their outputs are compared to 1e-5.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import CacheConfig, LayerConfig, LayerPolicy, SequenceError, StateError, persist
from kvlayout.mlx import attend
from kvlayout.registry import make_plugin_manager
from kvlayout.spec import QuantizedKV
from kvlayout_cell.cache import CellCache
from kvlayout_seq.mlx_cache import SeqCache
from tests.cell.support import snapshot
from tests.core.test_quantized_kv import bits_of, dequantize
from tests.helpers import TinyStack

WINDOWS = (0, 3, 5)  # a flat layer and two rings
PATHS = ("dense", "grouped", "paged")
BITS = {"q8": 8, "q4": 4}


def config(kv_dtype="q4", group=32, head_dim=32, windows=WINDOWS, capacity=64, max_seqs=8) -> CacheConfig:
    layers = [LayerConfig(2, head_dim, LayerPolicy("ring", w) if w else LayerPolicy()) for w in windows]
    return CacheConfig(
        capacity=capacity, n_layers=len(windows), layers=layers, kv_dtype=kv_dtype, kv_group_size=group,
        initial_capacity=8, max_seqs=max_seqs,
    )


def rows_of(x: mx.array, bits: int, group: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """`x` `[1, H, T, D]` quantized as a pool must store it: per token, its (packed, scales, biases)
    rows `[H, .]` as exact bits (scales and biases as uint16)."""
    packed, scales, biases = (np.array(a) for a in mx.quantize(x.astype(mx.float16), group_size=group, bits=bits))
    return [(packed[0, :, t], scales[0, :, t].view(np.uint16), biases[0, :, t].view(np.uint16))
            for t in range(x.shape[2])]


def values_of(row, bits: int, group: int) -> np.ndarray:
    """A token's (packed, scales, biases) bits `[H, .]` as float64 `[H, D]`, by the oracle."""
    packed, scales, biases = row
    return dequantize(packed, scales.view(np.float16), biases.view(np.float16), bits, group)


class History:
    """What each live sequence holds, per layer: position -> the K and V rows of its token."""

    def __init__(self, n_layers: int, bits: int, group: int):
        self.n_layers, self.bits, self.group = n_layers, bits, group
        self.seqs: dict[int, list[dict[int, tuple]]] = {}

    def new(self, s: int) -> None:
        self.seqs[s] = [{} for _ in range(self.n_layers)]

    def clone(self, src: int, dst: int, upto: int | None) -> None:
        self.seqs[dst] = [{p: e for p, e in layer.items() if upto is None or p < upto} for layer in self.seqs[src]]

    def rm(self, s: int, p0: int = 0, p1: int | None = None) -> None:
        for layer in self.seqs[s]:
            for p in [p for p in layer if p >= p0 and (p1 is None or p < p1)]:
                del layer[p]
        if not any(self.seqs[s]):
            del self.seqs[s]  # an id left owning nothing is released

    def next_pos(self, s: int) -> int:
        return max(self.seqs[s][0], default=-1) + 1

    def attention(self, layer: int, window: int, q: np.ndarray, seqs, positions, scale: float) -> np.ndarray:
        """float64 attention of each token `q` `[1, H_q, T, D]` over its own sequence's positions
        <= its own (and > pos - window on a ring layer), from the stored rows via the oracle."""
        out = np.zeros(q.shape, dtype=np.float64)
        rep = q.shape[1] // 2
        for t, (s, p) in enumerate(zip(seqs, positions)):
            held = self.seqs[s][layer]
            seen = sorted(j for j in held if j <= p and (not window or j > p - window))
            k = np.stack([values_of(held[j][0], self.bits, self.group) for j in seen], axis=1)  # [H_kv, n, D]
            v = np.stack([values_of(held[j][1], self.bits, self.group) for j in seen], axis=1)
            for h in range(q.shape[1]):
                scores = k[h // rep] @ q[0, h, t].astype(np.float64) * scale  # [n]
                w = np.exp(scores - scores.max())
                out[0, h, t] = (w / w.sum()) @ v[h // rep]
        return out


def assert_holds(cache: CellCache, history: History) -> None:
    """Every live sequence's cells hold its history's rows, bit for bit, at every layer: a flat
    layer's group every position, a ring's (window w) some of them, at least each position the
    sequence's next query (at newest + 1) sees, newest - w + 2 .. newest."""
    for grp in cache.groups.steppers:  # one id space in every layer group
        assert sorted(grp.table.live_ids().tolist()) == sorted(history.seqs)
    for s, layers in history.seqs.items():
        newest = max(layers[0], default=-1)
        for layer, held in enumerate(layers):
            cells, pos = cache.groups.stepper_of(layer).table.seq_cells(s)
            window = cache.groups.window(layer)
            assert set(pos.tolist()) <= set(held)
            if window:
                assert {p for p in held if p >= newest - window + 2} <= set(pos.tolist()), (layer, s)
            else:
                assert pos.tolist() == sorted(held)
            for pools, which in ((cache.key_pools, 0), (cache.value_pools, 1)):
                got = bits_of(pools[layer].take(cells))  # [1, H, n, .] each
                for part, bits in enumerate(got):
                    want = np.stack([held[p][which][part] for p in pos.tolist()], axis=1)
                    np.testing.assert_array_equal(bits[0], want)


class Trio:
    """One TinyStack driving a CellCache per attention path with identical steps and inputs."""

    def __init__(self, kv_dtype="q4", group=32, head_dim=32, windows=WINDOWS, paths=PATHS, capacity=64, stack=None):
        self.config = config(kv_dtype, group, head_dim, windows, capacity)
        self.windows = windows
        self.stack = stack or TinyStack(n_layers=len(windows), n_heads=4, n_kv_heads=2, head_dim=head_dim, seed=1)
        self.caches = {}
        for path in paths:
            c = CellCache(self.config, make_plugin_manager())
            c.attention_path = path
            self.caches[path] = c
        self.history = History(len(windows), BITS[kv_dtype], group)
        self.paged = 0  # batches the "paged" cache planned as pages

    @property
    def dense(self) -> CellCache:
        return next(iter(self.caches.values()))

    def all(self, verb, *args):
        answers = {getattr(c.as_batch_control(), verb)(*args) for c in self.caches.values()}
        assert len(answers) == 1, (verb, answers)
        return answers.pop()

    def new(self) -> int:
        s = self.all("seq_new")
        self.history.new(s)
        return s

    def clone(self, src: int, upto: int | None = None) -> int | None:
        """The fork's id; None when a ring layer group no longer holds the window the fork continues
        from (refused in every cache, nothing changed)."""
        if upto is not None and upto < self.history.next_pos(src) and self.below_floor(src, upto):
            return self.refused("seq_clone", src, upto)
        s = self.all("seq_clone", src, upto)
        self.history.clone(src, s, upto)
        return s

    def rm(self, s: int, p0: int = 0, p1: int | None = None) -> bool:
        """False when cutting s's end off at p0 would continue it below a ring's floor (refused in
        every cache, nothing changed)."""
        if (p1 is None or p1 >= self.history.next_pos(s)) and self.below_floor(s, p0):
            return self.refused("seq_rm", s, p0, p1) is not None
        self.all("seq_rm", s, p0, p1)
        self.history.rm(s, p0, p1)
        return True

    def below_floor(self, s: int, at: int) -> bool:
        return 0 < at < self.all("seq_floor", s)

    def refused(self, verb: str, *args) -> None:
        for c in self.caches.values():
            before = everything(c)
            with pytest.raises(SequenceError, match=rf"continued at position {args[1]} .* window-\d+ layers"):
                getattr(c.as_batch_control(), verb)(*args)
            assert_same(everything(c), before)

    def step(self, tokens: list[tuple[int, int]]) -> np.ndarray:
        """One forward of `(seq, input seed)` tokens at each sequence's next positions; per layer,
        every path against the reference to 1e-5 and against each other; the dense output."""
        seqs, positions, nxt = [s for s, _ in tokens], [], {}
        for s in seqs:
            nxt.setdefault(s, self.history.next_pos(s))
            positions.append(nxt[s])
            nxt[s] += 1
        x = mx.concatenate([self.stack.tokens(1, seed=seed) for _, seed in tokens], axis=1)  # [1, T, d]
        self.all("declare_step", seqs)
        h = self.history
        for layer, p in enumerate(self.stack.layers):
            q, k, v = self.stack.project_qkv(p, x)
            for t, (kr, vr) in enumerate(zip(rows_of(k, h.bits, h.group), rows_of(v, h.bits, h.group))):
                h.seqs[seqs[t]][layer][positions[t]] = (kr, vr)
            outs = {}
            for path, c in self.caches.items():
                spec = c.update_and_fetch(layer, positions, k, v)
                assert isinstance(spec.keys, QuantizedKV) and isinstance(spec.values, QuantizedKV)
                if c.attention_path != "auto":
                    assert (spec.groups is None) == (c.attention_path == "dense")
                if c.attention_path == "paged":
                    self.paged += sum(b.page > 0 for b in spec.groups.batches())
                outs[path] = attend(q, spec, self.stack.scale)
            want = h.attention(layer, self.windows[layer], np.array(q), seqs, positions, self.stack.scale)
            for path, o in outs.items():
                np.testing.assert_allclose(np.array(o), want, atol=1e-5, rtol=1e-5, err_msg=f"{path} layer {layer}")
                np.testing.assert_allclose(np.array(o), np.array(outs["dense"]), atol=1e-5, rtol=1e-5)
            x = self.stack.project_out(p, x, outs["dense"])
        for c in self.caches.values():
            assert_holds(c, h)
        return np.array(x)


def prefill(trio: Trio, s: int, n: int, seed: int) -> None:
    trio.step([(s, seed + i) for i in range(n)])


@pytest.mark.parametrize("kv_dtype, group, head_dim", [("q8", 32, 32), ("q4", 32, 32), ("q4", 64, 64), ("q8", 64, 64)])
def test_every_path_attends_the_dequantized_triples_of_several_sequences(kv_dtype, group, head_dim):
    trio = Trio(kv_dtype, group, head_dim)
    a, b, c = trio.new(), trio.new(), trio.new()
    trio.step([(a, i) for i in range(7)] + [(b, 10 + i) for i in range(2)] + [(c, 20 + i) for i in range(4)])
    trio.step([(b, 30 + i) for i in range(3)] + [(a, 40)])  # b's second chunk before a's decode
    f = trio.clone(a)
    # a's ring layers retired its first positions at the 2nd declaration (window 3 holds 4.. on, 5 holds
    # 2.. on): a fork continuing at 4 would need 2..3 in the window-3 layers; one at 6 has its windows
    assert trio.all("seq_floor", a) == 6 and trio.clone(a, upto=4) is None
    g = trio.clone(a, upto=6)
    trio.step([(a, 50), (f, 51), (g, 52), (g, 53), (c, 54)])
    trio.rm(b)  # frees b's cells, below the others
    d = trio.new()
    trio.step([(d, 60 + i) for i in range(6)] + [(c, 66)])  # d refills freed cells
    trio.rm(a, 2, 5)  # a hole inside a (f keeps those cells: they were shared)
    for i in range(3):
        trio.step([(s, 70 + 10 * i + s) for s in (a, f, g, c, d)])
    assert trio.paged > 0  # the paged cache planned pages (gathered from the triples when attended)


def test_a_q4_cache_differs_from_a_float32_one_by_more_than_the_tolerance():
    # The tolerance has teeth: quantization moves outputs far past 1e-5.
    trio = Trio("q4", 32, paths=("dense",))
    ref = CellCache(config("float32", 64), make_plugin_manager())
    ref_bc = ref.as_batch_control()
    s = trio.new()
    assert ref_bc.seq_new() == s
    out = trio.step([(s, i) for i in range(6)])
    assert ref_bc.declare_step([s] * 6)
    x = mx.concatenate([trio.stack.tokens(1, seed=i) for i in range(6)], axis=1)
    full = np.array(trio.stack.forward_cached(ref, x, list(range(6))))
    assert np.abs(out - full).max() > 1e-3


@settings(max_examples=15, deadline=None, derandomize=True)
@given(data=st.data(), kv_dtype=st.sampled_from(["q8", "q4"]))
def test_random_steps_forks_and_frees_agree_on_every_path(data, kv_dtype):
    trio = Trio(kv_dtype, 32, windows=(0, 2, 0))
    seed = 0
    for _ in range(data.draw(st.integers(3, 6), label="steps")):
        live = list(trio.history.seqs)
        verb = data.draw(st.sampled_from(["new", "clone", "rm", "step", "step"]) if live else st.just("new"))
        if verb == "new" and len(live) < 6:
            s = trio.new()
            prefill(trio, s, data.draw(st.integers(1, 5), label="prompt"), seed)
        elif verb == "clone" and len(live) < 6:
            src = data.draw(st.sampled_from(live))
            upto = data.draw(st.none() | st.integers(1, trio.history.next_pos(src)))
            trio.clone(src, upto)  # None, nothing changed, below a ring's floor
        elif verb == "rm" and len(live) > 1:
            s = data.draw(st.sampled_from(live))
            end = trio.history.next_pos(s)
            p0 = data.draw(st.integers(0, end), label="p0")
            trio.rm(s, p0, data.draw(st.none() | st.integers(p0, end), label="p1"))  # may free it whole, or be refused
        live = list(trio.history.seqs)
        if live:
            chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4, unique=True), label="decode")
            trio.step([(s, seed + i) for i, s in enumerate(chosen)])
        seed += 10


# -- forks share the quantized cells -------------------------------------------------------


def pool_bits(cache: CellCache, cells: list[np.ndarray]) -> list[tuple]:
    """Every layer's K then V pool at `cells[g]` of its layer group g."""
    pools = cache.key_pools + cache.value_pools
    n = len(cache.key_pools)
    return [bits_of(p.take(cells[cache.groups.group_of(i % n)])) for i, p in enumerate(pools)]


def layer_bits(cache: CellCache, s: int) -> list[dict]:
    """Per layer, position -> (cell, K bits, V bits) of what s holds in that layer's group."""
    out = []
    for layer in range(len(cache.key_pools)):
        cells, pos = cache.groups.stepper_of(layer).table.seq_cells(s)
        k, v = bits_of(cache.key_pools[layer].take(cells)), bits_of(cache.value_pools[layer].take(cells))
        out.append({p: (np.array(c), *(part[:, :, i] for part in k), *(part[:, :, i] for part in v))
                    for i, (c, p) in enumerate(zip(cells.tolist(), pos.tolist()))})
    return out


def test_a_fork_attends_its_trunks_packed_bytes_unchanged():
    trio = Trio("q4", 32)
    cache = trio.dense
    bc = cache.as_batch_control()
    trunk = trio.new()
    prefill(trio, trunk, 6, seed=0)
    cells, _ = cache.groups.primary.table.seq_cells(trunk)
    before = {path: layer_bits(c, trunk) for path, c in trio.caches.items()}
    free = bc.free_cells
    fork = trio.clone(trunk)
    part = trio.clone(trunk, upto=3)
    assert bc.free_cells == free  # nothing copied
    # The forks' first steps attend the trunk's stored rows (History shares them), and every cell
    # of the prefix is the trunk's own.
    trio.step([(fork, 100), (part, 101), (trunk, 102)])
    for i in range(3):
        trio.step([(fork, 110 + i), (part, 120 + i), (trunk, 130 + i)])
    assert bc.free_cells == free - 3 * 4
    for c in trio.caches.values():
        fork_cells, fork_pos = c.groups.primary.table.seq_cells(fork)
        part_cells, _ = c.groups.primary.table.seq_cells(part)
        np.testing.assert_array_equal(fork_cells[:6], cells)
        np.testing.assert_array_equal(part_cells[:3], cells[:3])
        assert fork_pos.tolist() == list(range(10))
    for path, c in trio.caches.items():  # no cell re-quantized: every bit of the prefix as it was
        for layer, was in enumerate(before[path]):  # in each layer group, where the trunk still holds it
            now = layer_bits(c, trunk)[layer]
            assert set(now) - set(range(6, 10)) <= set(was)
            for p in set(now) & set(was):
                for a, b in zip(now[p], was[p], strict=True):
                    np.testing.assert_array_equal(a, b)


# -- persistence ---------------------------------------------------------------------------


def busy(kv_dtype: str, group: int = 32, head_dim: int = 64) -> Trio:
    """One dense cache: three sequences, a fork sharing a prefix, a hole below used_end."""
    trio = Trio(kv_dtype, group, head_dim, paths=("dense",))
    a, b = trio.new(), trio.new()
    trio.step([(a, i) for i in range(6)] + [(b, 10 + i) for i in range(3)])
    c = trio.clone(a, upto=4)
    trio.step([(a, 20), (b, 21), (c, 22)])
    trio.rm(b, 1, 2)
    return trio


def table_state(cache: CellCache) -> tuple:
    """The counts, and each layer group's table and cuts."""
    out = [snapshot(cache)]
    for grp in cache.groups.steppers:
        cells, pos, owners = grp.table.occupied()
        cuts = None if grp.keeper is None else grp.keeper.cut.tolist()
        out.append((cells.tolist(), pos.tolist(), owners.tolist(), grp.table.live_ids().tolist(),
                    grp.table.free_list().tolist(), cuts))
    return tuple(out)


def occupied_bits(cache: CellCache) -> list[tuple]:
    return pool_bits(cache, [grp.table.occupied()[0] for grp in cache.groups.steppers])


def assert_same_bits(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for u, w in zip(x, y, strict=True):
            np.testing.assert_array_equal(u, w)


def assert_same(a: tuple, b: tuple) -> None:
    assert a[:2] == b[:2]
    assert_same_bits(a[2], b[2])


@pytest.mark.parametrize("kv_dtype, group", [("q8", 32), ("q4", 32), ("q4", 64)])
def test_a_saved_quantized_cache_loads_back_bit_for_bit(tmp_path, kv_dtype, group):
    trio = busy(kv_dtype, group)
    cache = trio.dense
    bc = cache.as_batch_control()
    path = cache.save(tmp_path / "cell.safetensors")
    f = persist.read_state(path)
    n = bc.capacity - bc.free_cells
    assert "k.0" not in f.tensors
    packed = f.tensors["k.0.packed"]
    assert packed.dtype == "U32" and packed.shape == (1, 2, n, 64 * BITS[kv_dtype] // 32)
    assert f.tensors["v.2.scales"].dtype == f.tensors["v.2.biases"].dtype == "F16"
    assert f.tensors["v.2.scales"].shape == (1, 2, bc.cells_by_window()[5], 64 // group)  # the ring's group's cells
    back = kvlayout.load(path)
    assert isinstance(back, CellCache) and back.config == cache.config
    assert (back.config.kv_dtype, back.config.kv_group_size) == (kv_dtype, group)
    assert table_state(back) == table_state(cache)
    assert_same_bits(occupied_bits(back), occupied_bits(cache))
    assert_holds(back, trio.history)  # against the independent record, not only the original
    # and it goes on as the original does, and as the oracle says
    live = cache.groups.primary.table.live_ids().tolist()
    trio.caches["loaded"] = back  # attention_path "auto"
    trio.step([(s, 200 + s) for s in live])


@pytest.mark.parametrize("kv_dtype", ["q8", "q4"])
def test_a_saved_quantized_sequence_loads_into_another_cache_bit_for_bit(tmp_path, kv_dtype):
    trio = busy(kv_dtype)
    src = trio.dense
    path = src.save_seq(2, tmp_path / "seq.safetensors")  # the fork: its cells are shared in src
    dst = CellCache(config(kv_dtype, 32, 64, capacity=32, max_seqs=4), make_plugin_manager())
    dst_bc = dst.as_batch_control()
    other = dst_bc.seq_new()
    dst_bc.declare_step([other])
    stack = trio.stack
    x = stack.tokens(1, seed=5)
    stack.forward_cached(dst, x, [0])
    sid = dst.load_seq(path)
    assert sid is not None and sid != other
    got, want = layer_bits(dst, sid), layer_bits(src, 2)  # per layer, in its own layer group
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        assert sorted(g) == sorted(w), layer
        for p in g:
            assert_same_bits([g[p][1:]], [w[p][1:]])
    assert dst.as_batch_control().seq_floor(sid) == src.as_batch_control().seq_floor(2)
    for layer, held in enumerate(trio.history.seqs[2]):  # against the independent record too
        cells, pos = dst.groups.stepper_of(layer).table.seq_cells(sid)
        packed = np.array(dst.key_pools[layer].take(cells).packed)[0]
        np.testing.assert_array_equal(packed, np.stack([held[p][0][0] for p in pos.tolist()], axis=1))


def raw_bits(a) -> tuple:
    """A pool read as exact bits: a triple's parts, or a float array as uint16/uint32."""
    if isinstance(a, QuantizedKV):
        return bits_of(a)
    return (np.array(a.view(mx.uint32 if a.dtype == mx.float32 else mx.uint16)),)


def everything(cache: CellCache) -> tuple:
    """The table, every pool's slots and every bit of every slot."""
    pools = cache.key_pools + cache.value_pools
    return table_state(cache), [p.slots for p in pools], [raw_bits(p.read(0, p.slots)) for p in pools]


@pytest.mark.parametrize(
    "kv_dtype, group, why",
    [
        ("q4", 64, "kv_group_size 32 vs 64"),
        ("q8", 32, "kv_dtype 'q4' vs 'q8'"),
        ("float16", 64, "kv_dtype 'q4' vs 'float16'"),
    ],
)
def test_a_sequence_is_refused_by_a_cache_of_another_quantization_and_nothing_changes(tmp_path, kv_dtype, group, why):
    path = busy("q4", 32).dense.save_seq(0, tmp_path / "seq.safetensors")
    dst = CellCache(config(kv_dtype, group, 64), make_plugin_manager())
    dst_bc = dst.as_batch_control()
    s = dst_bc.seq_new()
    assert dst_bc.declare_step([s, s])
    stack = TinyStack(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=64, seed=1)
    stack.forward_cached(dst, stack.tokens(2, seed=3), [0, 1])
    before = everything(dst)
    with pytest.raises(StateError, match=why):
        dst.load_seq(path)
    assert_same(everything(dst), before)
    assert dst_bc.seq_new() == s + 1  # the refused load claimed no id


# -- the seq layout ------------------------------------------------------------------------


def seq_run(stack: TinyStack, cache: SeqCache, x: mx.array, start: int, history: list[dict], bits: int, group: int,
            windows) -> np.ndarray:
    """`x` `[1, T, d]` through `cache` from `start`, each layer checked against the oracle over
    `history` (per layer: position -> K and V rows)."""
    t = x.shape[1]
    positions = list(range(start, start + t))
    for layer, p in enumerate(stack.layers):
        q, k, v = stack.project_qkv(p, x)
        for i, (kr, vr) in enumerate(zip(rows_of(k, bits, group), rows_of(v, bits, group))):
            history[layer][positions[i]] = (kr, vr)
        o = attend(q, cache.update_and_fetch(layer, positions, k, v), stack.scale)
        h = History(len(stack.layers), bits, group)
        h.seqs[0] = history
        want = h.attention(layer, windows[layer], np.array(q), [0] * t, positions, stack.scale)
        np.testing.assert_allclose(np.array(o), want, atol=1e-5, rtol=1e-5)
        x = stack.project_out(p, x, o)
    return np.array(x)


def kept_bits(cache: SeqCache) -> list[tuple]:
    """A flat layer's [0, length) and a ring's whole storage (its slots and their mirror), as exact bits."""
    out = []
    for policy, kp, vp in zip(cache.book.layers, cache.key_pools, cache.value_pools):
        n = policy.storage if policy.kind == "ring" else cache.as_control().length
        out += [bits_of(kp.read(0, n)), bits_of(vp.read(0, n))]
    return out


@pytest.mark.parametrize("kv_dtype, group", [("q8", 32), ("q4", 32)])
def test_a_saved_quantized_seq_cache_loads_back_bit_for_bit(tmp_path, kv_dtype, group):
    windows = (0, 4, 0)
    bits = BITS[kv_dtype]
    cache = kvlayout.build("mlx", "seq", config(kv_dtype, group, 32, windows, capacity=64))
    assert isinstance(cache, SeqCache)
    stack = TinyStack(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32, seed=2)
    x = stack.tokens(20, seed=4)
    history = [{} for _ in windows]
    for start in range(0, 16, 2):
        seq_run(stack, cache, x[:, start : start + 2], start, history, bits, group, windows)
    ring = cache.book.layers[1]
    assert cache.book.floor > 0 and ring.mirror == ring.slots == 7  # wrapped: every slot matters, twice
    # Positions 14 and 15 sit in slots 0 and 1 and their mirror 7 and 8: position 16's window
    # (13..16) is read as slots 6..9, two of them from the mirror the load must write too.
    path = cache.save(tmp_path / "seq.safetensors")
    f = persist.read_state(path)
    assert f.tensors["k.1.packed"].dtype == "U32" and f.tensors["k.1.scales"].dtype == "F16"
    back = kvlayout.load(path)
    assert isinstance(back, SeqCache) and back.config == cache.config
    assert (back.as_control().length, back.book.floor) == (cache.as_control().length, cache.book.floor)
    assert_same_bits(kept_bits(back), kept_bits(cache))
    for layer in (0, 2):  # the flat layers' slots hold the independent record
        got = np.array(back.key_pools[layer].read(0, back.as_control().length).packed)[0]
        np.testing.assert_array_equal(got, np.stack([history[layer][p][0][0] for p in range(16)], axis=1))
    # both go on the same, bit for bit, and as the oracle says
    outs = [seq_run(stack, c, x[:, 16:17], 16, [dict(h) for h in history], bits, group, windows) for c in (cache, back)]
    np.testing.assert_array_equal(outs[0], outs[1])
