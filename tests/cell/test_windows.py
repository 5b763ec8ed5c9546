"""Layer groups by window (issue 28, iSWA): each window's table holds exactly what its window still reads.

Every check is against an independent oracle written here from the stated rules, never the layout's
own code:

- `Model`: per sequence and layer group, the positions held (by token identity, so clones share
  cells) and where the group cut it. At each declaration a window group of window w retires each
  sequence placed since the previous one down to [newest - w + 1, newest]; a clone into a window
  group takes [max(src cut, last - w + 1), upto); continuing a sequence at 0 < u < cut + w - 1 (a
  clone's `upto` <= newest, a seq_rm cutting its end off at p0) is refused, nothing changed.
- attention by hand: query p of a sequence on a layer of window w attends the positions
  max(0, p - w + 1) .. p its sequence holds (all <= p on a flat layer), from the K/V it was given.
"""

from __future__ import annotations

import itertools
import re

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlayout
from kvlayout import CacheConfig, LayerConfig, LayerPolicy, SequenceError
from kvlayout.mlx import attend
from kvlayout.registry import make_plugin_manager
from kvlayout_cell.cache import CellCache
from kvlayout_cell.layer_groups import LayerGroups, batch_control

H_Q, H_KV, D = 4, 2, 8
SCALE = D**-0.5
WINDOW_SETS = [(0, 3, 0, 3), (4, 0), (3, 3), (0, 2, 5)]


class Model:
    """The cell layout's sequences by layer group, in plain Python (see the module docstring)."""

    def __init__(self, windows, capacity: int, max_seqs: int):
        self.layer_windows = tuple(windows)
        flat = [0] if 0 in windows else []
        self.windows = flat + sorted({w for w in windows if w}, reverse=True)  # primary first
        self.capacity, self.max_seqs = capacity, max_seqs
        self.content: dict[int, dict[int, int]] = {}  # live id -> position -> token
        self.held = [{} for _ in self.windows]  # per group: id -> position -> token
        self.cut = [{} for _ in self.windows]  # per group: id -> where it was cut (0: never)
        self.moved = [set() for _ in self.windows]  # per group: ids placed since the last declaration
        self.tokens = itertools.count()
        self.kv: dict[int, list] = {}  # token -> per layer (k [H_KV, D], v [H_KV, D])

    def next_pos(self, s: int) -> int:
        return max(self.content[s], default=-1) + 1

    def floor(self, g: int, s: int) -> int:
        w, cut = self.windows[g], self.cut[g][s]
        return cut + w - 1 if w and cut else 0

    def seq_floor(self, s: int) -> int:
        return max(self.floor(g, s) for g in range(len(self.windows)))

    def in_use(self, g: int, held=None) -> int:
        held = self.held[g] if held is None else held
        return len({t for pos in held.values() for t in pos.values()})

    def seq_new(self) -> int | None:
        s = next((i for i in range(self.max_seqs) if i not in self.content), None)
        if s is not None:
            self.content[s] = {}
            for g in range(len(self.windows)):
                self.held[g][s], self.cut[g][s] = {}, 0
        return s

    def continues_at(self, s: int, p: int) -> int:
        """Where s continues once its positions from p on are gone (or a clone of it up to p): one past
        its newest below p (a hole just below p is not there to continue from); with window groups
        only, as the widest group holds it, else its cut (the newest below p was retired)."""
        below = [q for q in (self.held[0][s] if self.windows[0] else self.content[s]) if q < p]
        return max(below) + 1 if below else (min(self.cut[0][s], p) if self.windows[0] else 0)

    def refusal(self, s: int, at: int) -> int | None:
        """The window of the first group (in group order) that refuses continuing s at `at`."""
        return next((self.windows[g] for g in range(len(self.windows)) if 0 < at < self.floor(g, s)), None)

    def retired(self, g: int) -> tuple[dict, dict]:
        """Group g's (held, cut) once the next declaration retired what moved on."""
        held, cut, w = {s: dict(p) for s, p in self.held[g].items()}, dict(self.cut[g]), self.windows[g]
        for s in self.moved[g] & set(self.content):
            if w and held[s] and max(held[s]) - w + 1 > cut[s]:
                cut[s] = max(held[s]) - w + 1
                held[s] = {p: t for p, t in held[s].items() if p >= cut[s]}
        return held, cut

    def declare(self, seqs) -> bool:
        after = [self.retired(g) for g in range(len(self.windows))]
        if any(len(seqs) > self.capacity - self.in_use(g, held) for g, (held, _) in enumerate(after)):
            return False
        for g, (held, cut) in enumerate(after):
            self.held[g], self.cut[g] = held, cut
            self.moved[g] = set()
        return True

    def place(self, seqs, positions, kv) -> None:
        for i, (s, p) in enumerate(zip(seqs, positions)):
            t = next(self.tokens)
            self.kv[t] = [(k[i], v[i]) for k, v in kv]
            self.content[s][p] = t
            for g in range(len(self.windows)):
                self.held[g][s][p] = t
                self.moved[g].add(s)

    def seq_clone(self, src: int, upto: int | None) -> int | None:
        dst = next((i for i in range(self.max_seqs) if i not in self.content), None)
        if dst is None:
            return None
        newest = self.next_pos(src) - 1
        last = newest if upto is None else min(self.continues_at(src, upto) - 1, newest)
        end = newest + 1 if upto is None else upto
        self.content[dst] = {p: t for p, t in self.content[src].items() if p < end}
        for g, w in enumerate(self.windows):
            since = max(self.cut[g][src], last - w + 1, 0) if w else 0
            self.held[g][dst] = {p: t for p, t in self.held[g][src].items() if since <= p < end}
            # as the layout does, even where src held nothing below since; an empty clone is cut nowhere
            self.cut[g][dst] = since if self.content[dst] else 0
        return dst

    def seq_rm(self, s: int, p0: int, p1: int | None) -> None:
        def gone(p):
            return p >= p0 and (p1 is None or p < p1)

        self.content[s] = {p: t for p, t in self.content[s].items() if not gone(p)}
        for g in range(len(self.windows)):
            self.held[g][s] = {p: t for p, t in self.held[g][s].items() if not gone(p)}
        if not self.content[s]:  # released: no group holds it any more
            del self.content[s]
            for g in range(len(self.windows)):
                del self.held[g][s], self.cut[g][s]
                self.moved[g].discard(s)

    def expected(self, s: int, layer: int, q: np.ndarray, p: int) -> np.ndarray:
        """float64 [H_Q, D]: query `q` [H_Q, D] of (s, p) on `layer`, from the K/V s holds."""
        w = self.layer_windows[layer]
        seen = sorted(j for j in self.content[s] if j <= p and (not w or j >= p - w + 1))
        k = np.stack([self.kv[self.content[s][j]][layer][0] for j in seen], axis=1).astype(np.float64)  # [H_KV, n, D]
        v = np.stack([self.kv[self.content[s][j]][layer][1] for j in seen], axis=1).astype(np.float64)
        out = np.zeros((H_Q, D))
        for h in range(H_Q):
            scores = k[h // (H_Q // H_KV)] @ q[h].astype(np.float64) * SCALE  # [n]
            e = np.exp(scores - scores.max())
            out[h] = (e / e.sum()) @ v[h // (H_Q // H_KV)]
        return out


# -- driving the layout and the model alike -----------------------------------------------------


def groups_of(target):
    return target.groups if hasattr(target, "groups") else target


def control_of(target):
    return target.as_batch_control() if hasattr(target, "as_batch_control") else batch_control(target)


def observed(target) -> tuple:
    """Everything the verbs may change: each group's occupied cells and live ids, the face's counts."""
    bc = control_of(target)
    tables = []
    for st_ in groups_of(target).steppers:
        cells, pos, owners = st_.table.occupied()
        tables.append((cells.tolist(), pos.tolist(), owners.tolist(), st_.table.live_ids().tolist()))
    live = groups_of(target).primary.table.live_ids().tolist()
    counts = (bc.free_cells, bc.used_end, [(bc.seq_len(s), bc.next_pos(s), bc.seq_floor(s)) for s in live])
    return tables, counts, bc.cells_by_window()


def agree(target, model: Model) -> None:
    """Each group's table holds exactly the model's positions per live sequence, one cell per token."""
    groups, bc = groups_of(target), control_of(target)
    assert list(groups.windows) == model.windows
    for g, st_ in enumerate(groups.steppers):
        assert st_.table.live_ids().tolist() == sorted(model.content)
        cell_of = {}  # token -> cell: shared exactly where the model shares a token
        for s in model.content:
            cells, pos = st_.table.seq_cells(s)
            assert pos.tolist() == sorted(model.held[g][s]), (g, s)
            for c, p in zip(cells.tolist(), pos.tolist()):
                assert cell_of.setdefault(model.held[g][s][p], c) == c
        assert len(set(cell_of.values())) == len(cell_of)
        assert st_.table.free_cells == model.capacity - model.in_use(g)
    assert bc.cells_by_window() == {w: model.in_use(g) for g, w in enumerate(model.windows)}
    assert bc.free_cells == model.capacity - model.in_use(0)
    for s in model.content:
        assert bc.next_pos(s) == model.next_pos(s) and bc.seq_floor(s) == model.seq_floor(s)


def refused(target, call, at: int, window: int) -> None:
    before = observed(target)
    with pytest.raises(SequenceError) as info:
        call()
    assert re.search(rf"position {at} .*window-{window} layers", str(info.value)), str(info.value)
    assert observed(target) == before


@st.composite
def verbs(draw, model: Model):
    """One verb the model is in a state to take: ("new",), ("step", [(s, n)]), ("clone", src, upto),
    ("rm", s, p0, p1)."""
    live = sorted(model.content)
    kinds = ["new"] + (["step", "step", "step", "clone", "rm"] if live else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "new":
        return ("new",)
    if kind == "step":
        seqs = draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
        return ("step", [(s, draw(st.integers(1, 4))) for s in seqs])
    s = draw(st.sampled_from(live))
    end = model.next_pos(s)
    if kind == "clone":
        return ("clone", s, draw(st.none() | st.integers(0, end + 1)))
    p0 = draw(st.integers(0, end))
    return ("rm", s, p0, draw(st.none() | st.integers(p0, end + 1)))


def apply(target, model: Model, verb, rng, serve) -> None:
    """Run `verb` on the layout and the model; a refusal where the model refuses, nothing changed."""
    bc = control_of(target)
    kind = verb[0]
    if kind == "new":
        assert bc.seq_new() == model.seq_new()
    elif kind == "step":
        seqs = [s for s, n in verb[1] for _ in range(n)]
        positions = [model.next_pos(s) + i for s, n in verb[1] for i in range(n)]
        ok = model.declare(seqs)
        assert bc.declare_step(seqs) == ok
        if ok:
            serve(target, model, seqs, positions, rng)
    elif kind == "clone":
        _, src, upto = verb
        at = None if upto is None or upto >= model.next_pos(src) else model.continues_at(src, upto)
        window = None if at is None else model.refusal(src, at)
        if window is not None:
            return refused(target, lambda: bc.seq_clone(src, upto), at, window)
        assert bc.seq_clone(src, upto) == model.seq_clone(src, upto)
    else:
        _, s, p0, p1 = verb
        at = model.continues_at(s, p0) if p1 is None or p1 >= model.next_pos(s) else None
        window = None if at is None else model.refusal(s, at)
        if window is not None:
            return refused(target, lambda: bc.seq_rm(s, p0, p1), at, window)
        bc.seq_rm(s, p0, p1)
        model.seq_rm(s, p0, p1)
    agree(target, model)


def place_only(groups, model, seqs, positions, rng):
    """Serve a step on every layer of bare LayerGroups (no pools): the placement alone."""
    for layer in range(groups.n_layers):
        groups.place_step(layer, positions)
    model.place(seqs, positions, [(np.zeros((len(seqs), H_KV, D)),) * 2] * groups.n_layers)


# -- (a) the tables against the model ------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(windows=st.sampled_from(WINDOW_SETS), data=st.data())
def test_each_group_holds_exactly_what_its_window_still_reads(windows, data):
    groups = LayerGroups(windows, capacity=48, max_seqs=6, pm=make_plugin_manager())
    model = Model(windows, 48, 6)
    for _ in range(data.draw(st.integers(4, 24), label="verbs")):
        apply(groups, model, data.draw(verbs(model), label="verb"), None, place_only)


def test_a_clone_below_the_floor_is_refused_naming_the_window_and_nothing_changes():
    groups = LayerGroups((0, 3), capacity=32, max_seqs=4, pm=make_plugin_manager())
    model = Model((0, 3), 32, 4)
    apply(groups, model, ("new",), None, place_only)
    apply(groups, model, ("step", [(0, 8)]), None, place_only)
    apply(groups, model, ("step", [(0, 1)]), None, place_only)  # retires 0..4: cut 5, floor 7
    assert control_of(groups).seq_floor(0) == 7
    for upto in (1, 4, 6):
        apply(groups, model, ("clone", 0, upto), None, place_only)  # refused, by the window-3 group
    for upto in (7, 9, None):
        apply(groups, model, ("clone", 0, upto), None, place_only)


def test_a_cut_below_a_hole_continues_below_the_hole_and_is_refused_where_that_window_was_retired():
    # Positions 1..2 removed, then 3.. cut: the sequence continues at 1 (one past its newest, 0), not at
    # 3; its window-3 group retired position 0 at position 4, so the cut is refused, nothing changed
    # (hypothesis found it: continuing at 1 then attended without position 0 in the window layers).
    windows = (0, 3, 0, 3)
    target, model = Paths(windows, capacity=3 * 128), Model(windows, 3 * 128, 6)
    rng = np.random.default_rng(0)
    for verb in [("new",), ("step", [(0, 1)]), ("step", [(0, 1)]), ("step", [(0, 2)]), ("step", [(0, 1)]),
                 ("rm", 0, 1, 3)]:
        apply(target, model, verb, rng, serve_paths)
    refused(target, lambda: control_of(target).seq_rm(0, 3, None), 1, 3)
    refused(target, lambda: control_of(target).seq_clone(0, 3), 1, 3)  # a clone up to 3 continues at 1 too
    apply(target, model, ("step", [(0, 1)]), rng, serve_paths)  # the sequence goes on at 5


def test_an_empty_clone_is_cut_nowhere():
    groups = LayerGroups((0, 3), capacity=32, max_seqs=4, pm=make_plugin_manager())
    model = Model((0, 3), 32, 4)
    for verb in [("new",), ("step", [(0, 4)]), ("step", [(0, 1)]), ("clone", 0, 0)]:
        apply(groups, model, verb, None, place_only)


# -- (b) attention on every path against the dense oracle -----------------------------------------


def cache_of(windows, capacity=64, max_seqs=6, path="dense") -> CellCache:
    layers = [LayerConfig(H_KV, D, LayerPolicy("ring", w) if w else LayerPolicy()) for w in windows]
    c = CellCache(CacheConfig(capacity=capacity, n_layers=len(windows), layers=layers, kv_dtype="float32",
                              initial_capacity=4, max_seqs=max_seqs), make_plugin_manager())
    c.attention_path = path
    return c


class Paths:
    """One cache per attention path, driven alike: the target `apply` drives."""

    def __init__(self, windows, paths=("dense", "grouped", "paged"), **kw):
        self.caches = [cache_of(windows, path=p, **kw) for p in paths]
        self.groups = self.caches[0].groups

    def as_batch_control(self):
        return Fanout(self.caches)


class Fanout:
    """A BatchControl over several caches: each verb on all, one answer."""

    def __init__(self, caches):
        self.caches = caches

    def __getattr__(self, name):
        values = [getattr(c.as_batch_control(), name) for c in self.caches]
        if not callable(values[0]):  # a count
            assert len(set(values)) == 1, (name, values)
            return values[0]

        def call(*args):
            answers = [getattr(c.as_batch_control(), name)(*args) for c in self.caches]
            assert all(repr(a) == repr(answers[0]) for a in answers), (name, answers)
            return answers[0]

        return call


def serve_paths(target, model, seqs, positions, rng):
    """Serve a step on every layer of every cache with the same q/k/v; each path's output against
    the oracle."""
    caches = target.caches if isinstance(target, Paths) else [target]
    n_layers = caches[0].n_layers
    data = [[rng.normal(size=(1, h, len(seqs), D)).astype(np.float32) for h in (H_Q, H_KV, H_KV)]
            for _ in range(n_layers)]
    model.place(seqs, positions, [(k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2)) for _, k, v in data])
    for layer, (q, k, v) in enumerate(data):
        want = np.stack([model.expected(s, layer, q[0, :, t], p) for t, (s, p) in enumerate(zip(seqs, positions))],
                        axis=1)  # [H_Q, T, D]
        for c in caches:
            spec = c.update_and_fetch(layer, positions, mx.array(k), mx.array(v))
            got = np.array(attend(mx.array(q), spec, SCALE))[0]
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f"{c.attention_path} layer {layer}")


@settings(max_examples=30, deadline=None)
@given(windows=st.sampled_from([(0, 3, 0, 3), (4, 0), (3, 3)]), data=st.data())
def test_every_path_attends_what_the_window_of_each_layer_sees(windows, data):
    target = Paths(windows, capacity=3 * 128)  # pages of their own (kvlayout_cell.groups.PLACEMENT_PAGE)
    model = Model(windows, 3 * 128, 6)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    for _ in range(data.draw(st.integers(4, 14), label="verbs")):
        apply(target, model, data.draw(verbs(model), label="verb"), rng, serve_paths)


# -- (c) what a window group costs -----------------------------------------------------------------


def decode_four(c: CellCache) -> None:
    """4 sequences: 32-token prompts in one step, then 200 decode steps of one token each; after
    every step the window-8 group holds at most each sequence's last window plus the step's tokens,
    the flat group every token."""
    c = c
    bc = c.as_batch_control()
    seqs = [bc.seq_new() for _ in range(4)]
    rng = np.random.default_rng(3)
    k = mx.array(rng.normal(size=(1, H_KV, 4 * 32, D)).astype(np.float32))
    prompt = [s for s in seqs for _ in range(32)]
    steps = [(prompt, [p for _ in seqs for p in range(32)])] + [(seqs, [32 + i] * 4) for i in range(200)]
    held = 0
    for ids, positions in steps:
        assert bc.declare_step(ids)
        for layer in range(2):
            c.update_and_fetch(layer, positions, k[:, :, : len(ids)], k[:, :, : len(ids)])
        held += len(ids)
        used = bc.cells_by_window()
        assert used[8] <= 4 * 8 + len(ids), used
        assert used[0] == held == bc.capacity - bc.free_cells


def test_a_window_group_holds_its_windows_while_the_flat_group_holds_every_token():
    decode_four(cache_of((0, 8), capacity=4 * 232 + 8, max_seqs=4))


def test_a_window_group_s_pool_stays_far_below_the_flat_one_s():
    c = cache_of((0, 8), capacity=4 * 232 + 8, max_seqs=4)
    decode_four(c)
    assert c.key_pools[1].slots * 4 <= c.key_pools[0].slots, (c.key_pools[1].slots, c.key_pools[0].slots)


# -- (d) saving and loading a cache with retired cells -----------------------------------------------


def retired_cache(rng) -> tuple[CellCache, Model]:
    c = cache_of((0, 3, 0, 4))
    model = Model((0, 3, 0, 4), 64, 6)
    for verb in [("new",), ("new",), ("step", [(0, 7), (1, 3)]), ("step", [(0, 1), (1, 2)]), ("clone", 0, None),
                 ("step", [(2, 1), (1, 1)]), ("rm", 1, 1, 2), ("step", [(0, 2)])]:
        apply(c, model, verb, rng, serve_paths)
    assert any(c.as_batch_control().seq_floor(s) for s in model.content)  # something was cut
    return c, model


def pools_at_occupied(c: CellCache) -> list[np.ndarray]:
    out = []
    for layer in range(c.n_layers):
        cells = mx.array(c.groups.stepper_of(layer).table.occupied()[0].astype(np.int32))
        out += [np.array(c.key_pools[layer].take(cells)), np.array(c.value_pools[layer].take(cells))]
    return out


def test_a_cache_with_retired_cells_loads_back_with_its_tables_cuts_and_pools(tmp_path):
    rng = np.random.default_rng(5)
    c, model = retired_cache(rng)
    back = kvlayout.load(c.save(tmp_path / "c.safetensors"))
    assert observed(back) == observed(c)
    for a, b in zip(back.groups.steppers, c.groups.steppers, strict=True):
        assert a.table.free_list().tolist() == b.table.free_list().tolist()
        assert (a.keeper is None) == (b.keeper is None)
        if a.keeper is not None:  # where each window group cut each id
            assert a.keeper.cut.tolist() == b.keeper.cut.tolist()
    agree(back, model)
    for x, y in zip(pools_at_occupied(back), pools_at_occupied(c), strict=True):
        np.testing.assert_array_equal(x, y)
    apply(back, model, ("step", [(0, 1), (2, 2)]), rng, serve_paths)  # goes on as the oracle says


def test_a_saved_sequence_with_a_cut_keeps_its_floor_and_goes_on_alike(tmp_path):
    rng = np.random.default_rng(6)
    c, model = retired_cache(rng)
    floor = c.as_batch_control().seq_floor(0)
    assert floor > 0
    dst = cache_of((0, 3, 0, 4))
    sid = dst.load_seq(c.save_seq(0, tmp_path / "s.safetensors"))
    assert dst.as_batch_control().seq_floor(sid) == floor
    for g, st_ in enumerate(dst.groups.steppers):
        assert st_.table.seq_cells(sid)[1].tolist() == c.groups.steppers[g].table.seq_cells(0)[1].tolist()
    p = model.next_pos(0)
    q, k, v = (mx.array(rng.normal(size=(1, h, 1, D)).astype(np.float32)) for h in (H_Q, H_KV, H_KV))
    for cache, s in ((c, 0), (dst, sid)):
        assert cache.as_batch_control().declare_step([s])
    assert model.declare([0])
    model.place([0], [p], [(np.array(k)[0].transpose(1, 0, 2), np.array(v)[0].transpose(1, 0, 2))] * 4)
    for layer in range(4):
        outs = [np.array(attend(q, cache.update_and_fetch(layer, [p], k, v), SCALE)) for cache in (c, dst)]
        np.testing.assert_allclose(outs[0], outs[1], atol=1e-6, rtol=1e-6)  # its cells in another order
        want = model.expected(0, layer, np.array(q)[0, :, 0], p)  # [H_Q, D]
        np.testing.assert_allclose(outs[1][0, :, 0], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(SequenceError, match=rf"position {floor - 1} .*window-\d layers"):  # the cut came along
        dst.as_batch_control().seq_rm(sid, floor - 1)


# -- (e) taking back a token drawn ahead ------------------------------------------------------------


def test_the_newest_token_can_be_taken_back_but_not_one_more_after_a_declaration():
    groups = LayerGroups((0, 3), capacity=32, max_seqs=2, pm=make_plugin_manager())
    model = Model((0, 3), 32, 2)
    apply(groups, model, ("new",), None, place_only)
    apply(groups, model, ("step", [(0, 6)]), None, place_only)
    n = model.next_pos(0) - 1  # 5
    apply(groups, model, ("rm", 0, n - 1, None), None, place_only)  # no declaration since: 0..5 all held
    apply(groups, model, ("step", [(0, 2)]), None, place_only)  # 4, 5 again
    apply(groups, model, ("step", [(0, 1)]), None, place_only)  # places n + 1 = 6, retires to 3..5
    n = model.next_pos(0) - 1
    apply(groups, model, ("step", [(0, 1)]), None, place_only)  # a further declaration: keeps n - 2 .. n
    n = model.next_pos(0) - 1
    bc = control_of(groups)
    assert bc.declare_step([0])  # retires to the last window: n - 2 .. n
    model.declare([0])
    assert groups.stepper_of(1).table.seq_cells(0)[1].tolist() == [n - 2, n - 1, n]
    refused(groups, lambda: bc.seq_rm(0, n - 1), n - 1, 3)
    bc.seq_rm(0, n)  # the token drawn ahead goes back: the window n - 2 .. n - 1 it continues from is held
    model.seq_rm(0, n, None)
    agree(groups, model)
    apply(groups, model, ("step", [(0, 1)]), None, place_only)  # and n is placed again
    assert groups.stepper_of(1).table.seq_cells(0)[1].tolist() == [n - 2, n - 1, n]


def test_a_clone_up_to_a_hole_keeps_the_window_it_continues_from_and_still_counts_what_it_lacks():
    groups = LayerGroups((4, 0), capacity=64, max_seqs=4, pm=make_plugin_manager())
    s = groups.seq_new()
    assert groups.declare_step([s] * 30)
    for layer in (0, 1):
        groups.place_step(layer, list(range(30)))
    groups.seq_rm(s, 10, 20)  # a hole: both tables hold 0..9 and 20..29
    d = groups.seq_clone(s, 15)  # flat: 0..9; it continues at 10, so the window's table keeps 6..9
    assert groups.steppers[1].table.seq_cells(d)[1].tolist() == [6, 7, 8, 9]
    assert groups.primary.table.next_pos(d) == 10
    before = [g.table.occupied() for g in groups.steppers]
    with pytest.raises(SequenceError, match=r"position 8 needs positions 5\.\.7 in its window-4 layers"):
        groups.seq_clone(d, 8)  # its window layers would read 5..7, which it does not hold
    for (c0, p0, o0), (c1, p1, o1) in zip(before, [g.table.occupied() for g in groups.steppers]):
        assert c0.tolist() == c1.tolist() and p0.tolist() == p1.tolist() and (o0 == o1).all()


def test_a_sequence_one_group_refuses_to_place_leaves_nothing_in_any_and_is_heard_taken_back():
    from kvlayout import hookimpl
    from kvlayout.errors import StepError

    class RefusesWindow4:
        def __init__(self):
            self.heard = []

        @hookimpl
        def kvlayout_step_placed(self, step, window):
            self.heard.append(("placed", window))
            if window == 4:
                raise RuntimeError("not this one")

        @hookimpl
        def kvlayout_step_aborted(self, step, window):
            self.heard.append(("aborted", window))

    pm = make_plugin_manager()
    observer = RefusesWindow4()
    pm.register(observer)
    groups = LayerGroups((0, 4), capacity=16, max_seqs=4, pm=pm)
    with pytest.raises(StepError, match="not this one"):
        groups.place_sequence([[0, 1, 2], [1, 2]], [0, 1])
    assert observer.heard == [("placed", 0), ("placed", 4), ("aborted", 4), ("aborted", 0)]
    for g in groups.steppers:  # every table as built: nothing occupied, no id live, no open step
        assert g.table.occupied()[0].size == 0 and g.table.live_ids().size == 0 and not g.placing
    assert groups.seq_new() == 0


def six_positions_of_one_sequence():
    """(cache, id): a cache of a flat and a window-4 layer whose one sequence holds positions 0..5."""
    c = cache_of((0, 4))
    bc = c.as_batch_control()
    s = bc.seq_new()
    assert bc.declare_step([s] * 6)
    for layer in range(2):
        c.update_and_fetch(layer, list(range(6)), mx.ones((1, 2, 6, 8)), mx.ones((1, 2, 6, 8)))
    return c, s


def test_a_file_whose_window_table_holds_what_the_flat_one_does_not_is_refused(tmp_path):
    from kvlayout.errors import StateError
    from kvlayout.persist import numpy_of, raw_numpy, read_state, save_state

    c, s = six_positions_of_one_sequence()
    f = read_state(c.save(tmp_path / "good.kv"))
    assert kvlayout.load(tmp_path / "good.kv").as_batch_control().cells_by_window() == {0: 6, 4: 6}
    tensors = dict(f.tensors)
    tensors["pos.g1"] = raw_numpy(numpy_of(tensors["pos.g1"]) + 100)  # positions 100..105: not in the flat table
    save_state(tmp_path / "bad.kv", layout="mlx:cell", content="cache", config=c.config, state=f.state,
               tensors=tensors)
    with pytest.raises(StateError, match=r"owners\.g1: a sequence holds a position in the window-4 layers' table"):
        kvlayout.load(tmp_path / "bad.kv")


def test_a_saved_sequence_whose_window_positions_the_flat_ones_lack_is_refused_and_nothing_changes(tmp_path):
    from kvlayout.errors import StateError
    from kvlayout.persist import numpy_of, raw_numpy, read_state, save_state

    c, s = six_positions_of_one_sequence()
    f = read_state(c.save_seq(s, tmp_path / "one.kv"))
    tensors = {**f.tensors, "pos.g1": raw_numpy(numpy_of(f.tensors["pos.g1"]) + 100)}
    save_state(tmp_path / "bad.kv", layout="mlx:cell", content="sequence", config=c.config, state=f.state,
               tensors=tensors)
    before = [g.table.occupied()[0].tolist() for g in c.groups.steppers]
    with pytest.raises(StateError, match=r"pos\.g1: a position the primary table's pos does not hold"):
        c.load_seq(tmp_path / "bad.kv")
    assert [g.table.occupied()[0].tolist() for g in c.groups.steppers] == before
    assert c.load_seq(tmp_path / "one.kv") == 1  # the good file takes the next id
