"""The default placement keeps each sequence in pages of its own (issue 15, item 1).

Under continuous batching every decode step interleaves the running sequences' tokens; lowest-free
placement then spreads each sequence one cell per page, and the paged attention path reads nothing
in place. The cell plugin's default continues each sequence in its own page instead. Here: the
plugin's answers against a plain-Python model of the rule, what a long batched run leaves behind
(against lowest-free), outputs through a model under it, and load_seq placing through it.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlayout import CacheConfig, LayerConfig, LayerPolicy, hookimpl
from kvlayout.registry import make_plugin_manager
from kvlayout_cell.cache import CellCache
from kvlayout_cell.groups import PLACEMENT_PAGE, plan_cells
from kvlayout_cell.plugin import LowestFree, own_pages
from tests.cell.support import naive_placement, stepper
from tests.helpers import TinyStack

B = PLACEMENT_PAGE


@functools.cache
def default_manager():
    """One manager with the cell plugin's own placement, for every example."""
    return make_plugin_manager()


def lowest_free_manager():
    pm = make_plugin_manager()
    pm.register(LowestFree())
    return pm


# -- (a) the plugin's answers against the rule written out ----------------------------------------


PAGES = st.sampled_from([4, 8, 16, B])


@st.composite
def tables_and_steps(draw, pages=PAGES, decode=False):
    """(page, free cells, tokens [(seq, prev_cell)]): a table of runs of free and occupied cells,
    and a step whose sequences continue from occupied cells (forks sharing one) or start afresh;
    `decode`: one token a sequence, as every decode step of a batch is."""
    page = draw(pages, label="page")
    runs = draw(st.lists(st.tuples(st.booleans(), st.integers(1, 3 * page)), min_size=1, max_size=12), label="runs")
    is_free = np.concatenate([np.full(n, f) for f, n in runs])
    free, occupied = np.flatnonzero(is_free), np.flatnonzero(~is_free).tolist()
    if not free.size:
        free, is_free = np.array([is_free.size]), np.r_[is_free, True]
    n_seqs = draw(st.integers(1, 6), label="sequences")
    # A decoding batch's sequences usually each end a run of cells, a free cell after it.
    ends = [c for c in occupied if c + 1 < is_free.size and is_free[c + 1]] if decode else []
    if ends and draw(st.booleans(), label="each at a run's end"):  # distinct ones, or forks sharing one
        prev = draw(st.lists(st.sampled_from(ends), min_size=1, max_size=min(n_seqs, len(ends)),
                             unique=draw(st.booleans(), label="distinct")), label="prev cells")
        n_seqs = len(prev)
    else:
        prev = [draw(st.sampled_from([-1] + occupied), label="prev cell") for _ in range(n_seqs)]
    sizes = [1 if decode else draw(st.integers(1, 2 * page + 3), label="tokens") for _ in range(n_seqs)]
    tokens = [(s, prev[s]) for s in range(n_seqs) for _ in range(sizes[s])][: free.size]
    if draw(st.booleans(), label="interleaved"):
        tokens = draw(st.permutations(tokens), label="order")
    return page, free, tokens


def answer(free, tokens, page, run_on=True):
    seq_ids = np.array([s for s, _ in tokens], dtype=np.int64)
    prev = np.array([c for _, c in tokens], dtype=np.int64)
    return own_pages(free, seq_ids, prev, page, run_on=run_on).tolist()


@given(tables_and_steps(), st.booleans())
def test_the_default_placement_follows_its_rule_on_any_table(case, run_on):
    page, free, tokens = case
    got = answer(free, tokens, page, run_on)  # run_on False: a window's table, fresh pages from the lowest
    assert got == naive_placement(free.tolist(), tokens, page, run_on)
    assert len(set(got)) == len(tokens) and set(got) <= set(free.tolist())  # what the registry checks


@given(tables_and_steps(decode=True), st.booleans())
def test_a_decode_step_of_many_sequences_follows_the_rule_too(case, run_on):
    # One token a sequence: the placement settles the usual case (each continuing in its page)
    # without sorting by sequence, and must answer what the rule says whether it may or not.
    page, free, tokens = case
    assert answer(free, tokens, page, run_on) == naive_placement(free.tolist(), tokens, page, run_on)


# The page a table's sequences take cells in, as the hookspec states it: B for the flat layers', the
# least power of two covering a window for a window's (at most B).
PAGE_OF_WINDOW = {0: B, 3: 4, 8: 8, 100: 128, 512: B}


@given(tables_and_steps(pages=st.just(B)), st.sampled_from(sorted(PAGE_OF_WINDOW)))
def test_the_plugins_hook_answers_the_rule_over_its_own_pages(case, window):
    _, free, tokens = case
    free.flags.writeable = False  # as the stepper hands it over
    got = default_manager().hook.kvlayout_choose_cells(
        free=free,
        count=len(tokens),
        seq_ids=np.array([s for s, _ in tokens], dtype=np.int64),
        positions=np.arange(len(tokens)),
        prev_cells=np.array([c for _, c in tokens], dtype=np.int64),
        window=window,
    )
    want = naive_placement(free.tolist(), tokens, PAGE_OF_WINDOW[window], run_on=window == 0)
    assert np.asarray(got).tolist() == want


def test_a_sequence_continues_in_its_page_then_takes_the_next_one():
    t = stepper(capacity=4 * B, windows=(0,), pm=make_plugin_manager())
    a, b = t.seq_new(), t.seq_new()
    assert fill_cells(t, [(a, B - 2)]) == list(range(B - 2))  # a fresh page, from its first cell
    assert fill_cells(t, [(b, 3)]) == [B, B + 1, B + 2]  # b's own page, not a's last two cells
    assert fill_cells(t, [(b, 1), (a, 3)]) == [B + 3, B - 2, B - 1, 2 * B]  # a fills its page, runs on


def test_a_fork_and_its_source_part_ways_into_pages_of_their_own():
    t = stepper(capacity=4 * B, windows=(0,), pm=make_plugin_manager())
    a = t.seq_new()
    fill_cells(t, [(a, 5)])
    f = t.seq_clone(a)
    assert fill_cells(t, [(a, 1), (f, 1)]) == [5, B]  # a continues; f takes the page after
    assert fill_cells(t, [(f, 1), (a, 1)]) == [B + 1, 6]


def test_without_a_fresh_page_the_lowest_free_cells_are_taken():
    t = stepper(capacity=2 * B, windows=(0,), pm=make_plugin_manager())
    a, b, c = t.seq_new(), t.seq_new(), t.seq_new()
    fill_cells(t, [(a, 2), (b, 2)])  # pages 0 and 1, two cells each
    assert fill_cells(t, [(c, 3)]) == [2, 3, 4]  # no page is all free: lowest free
    assert fill_cells(t, [(a, 1)]) == [5]  # a's next cell is c's


def fill_cells(t, parts):
    """One step of `[(seq, n tokens), ...]` on every layer; the cells, in token order."""
    seqs = [s for s, n in parts for _ in range(n)]
    positions, nxt = [], {}
    for s in seqs:
        nxt[s] = nxt.get(s, t.table.next_pos(s))
        positions.append(nxt[s])
        nxt[s] += 1
    assert t.declare_step(seqs)
    steps = [t.place_step(layer, positions) for layer in range(t.n_layers)]
    return steps[0].cells.tolist()


# -- (b) a long batched run: pages touched, and what the planner reads in place --------------------


def batched_run(pm, n_seqs=8, decode_steps=200, seed=0):
    """8 sequences prefilled (two at a time, in chunks), then decoding together, a fork (seq_clone)
    and a free (seq_rm) every 25 steps; the stepper at the end."""
    rng = np.random.default_rng(seed)
    t = stepper(capacity=8192, windows=(0,), max_seqs=32, pm=pm)
    ids = [t.seq_new() for _ in range(n_seqs)]
    prompts = {s: int(rng.integers(40, 130)) for s in ids}
    for pair in zip(ids[::2], ids[1::2]):
        while any(t.table.next_pos(s) < prompts[s] for s in pair):
            fill_cells(
                t, [(s, min(48, prompts[s] - t.table.next_pos(s))) for s in pair if t.table.next_pos(s) < prompts[s]]
            )
    forked = set()
    for i in range(decode_steps):
        live = t.table.live_ids().tolist()
        fill_cells(t, [(s, 1) for s in live])
        unforked = [s for s in live if s not in forked]
        if i % 25 == 24 and unforked:
            src = int(rng.choice(unforked))
            forked |= {src, t.seq_clone(src)}  # each forked once: its source loses at most one page run
            t.seq_rm(int(rng.choice([s for s in live if s != src])))
    return t


def pages_touched(t, page=B):
    """seq -> (cells it holds, pages of `page` cells they lie in)."""
    out = {}
    for s in t.table.live_ids().tolist():
        cells, _ = t.table.seq_cells(s)
        out[s] = (cells.size, np.unique(cells // page).size)
    return out


def read_in_place(t) -> float:
    """The share of the next decode step's visible cells that the planner reads as pages in place
    (K/V rows of 512 elements, float32 on the CPU: what "auto" pages)."""
    live = t.table.live_ids()
    positions = np.array([t.table.next_pos(s) for s in live])
    plan = plan_cells(live, positions, 0, t.table.used_end, t.table.seq_keys, "auto", t.table.held, (8192, 512))
    in_place = seen = 0
    for b in plan.batches():
        mask = np.ones((b.tokens.shape[0], b.tokens.shape[1], b.cells.shape[1] * max(b.page, 1)
                        + (0 if b.tail is None else b.tail.shape[1])), bool) if b.mask is None else b.mask[:, 0]
        seen += int(mask.sum())
        in_place += int(mask[:, :, : b.cells.shape[1] * b.page].sum()) if b.page else 0
    return in_place / seen


def test_a_long_batched_run_keeps_each_sequence_in_pages_of_its_own_where_lowest_free_scatters_it():
    pages = pages_touched(batched_run(make_plugin_manager()))
    for s, (length, touched) in pages.items():
        assert touched <= math.ceil(length / B) + 2, (s, length, touched)
    scattered = pages_touched(batched_run(lowest_free_manager()))
    # Lowest-free puts each decode token one cell beside the others' (8 live sequences): a page of
    # 128 holds ~16 of a sequence's decoded cells, so its 200 decoded tokens touch ~12 pages, not ~2.
    assert sum(n for _, n in scattered.values()) >= 3 * sum(n for _, n in pages.values())
    for s, (length, touched) in scattered.items():
        assert touched >= 3 * math.ceil(length / B), (s, length, touched)


def test_after_the_run_the_planner_reads_most_cells_in_place_only_under_the_default():
    assert read_in_place(batched_run(make_plugin_manager())) > 0.9
    assert read_in_place(batched_run(lowest_free_manager())) < 0.5  # only the prompts' pages


# -- (c) a model's outputs through the cache under the default placement --------------------------

STACK = TinyStack(n_layers=3)
WINDOWS = (0, 5, 0)


def model_cache(capacity=4 * B) -> CellCache:
    layers = [
        LayerConfig(STACK.n_kv_heads, STACK.head_dim, LayerPolicy("ring", w) if w else LayerPolicy()) for w in WINDOWS
    ]
    config = CacheConfig(capacity=capacity, n_layers=3, layers=layers, kv_dtype="float32", initial_capacity=8)
    return CellCache(config, make_plugin_manager())


@pytest.mark.parametrize("path", ["auto", "paged", "grouped"])
def test_outputs_equal_each_sequences_solo_run_with_forks_and_frees(path):
    # Prompts long enough to fill half a page, so "paged" reads the pages they lie in; decodes
    # side by side, one sequence forked and another freed part way.
    cache = model_cache()
    bc = cache.as_batch_control()
    cache.attention_path = path
    prompt, end = B // 2 + 8, B // 2 + 16
    xs = {s: STACK.tokens(end, seed=30 + s) for s in range(3)}
    history = {}  # seq -> its tokens so far, [1, n, d]
    ids = [bc.seq_new() for _ in xs]
    for s in ids:
        out = run_step(cache, [(s, xs[s][:, :prompt], 0)])[0]
        history[s] = xs[s][:, :prompt]
        close(out, STACK.forward_reference(history[s], WINDOWS))
    for i in range(prompt, end):
        if i == prompt + 3:
            fork = bc.seq_clone(ids[0])
            history[fork] = history[ids[0]]
            xs[fork] = mx.concatenate([history[fork], STACK.tokens(end - i, seed=40)], axis=1)
            bc.seq_rm(ids[1])
            del history[ids[1]]
        parts = [(s, xs[s][:, i : i + 1], i) for s in sorted(history)]
        for (s, x, _), out in zip(parts, run_step(cache, parts)):
            history[s] = mx.concatenate([history[s], x], axis=1)
            close(out, STACK.forward_reference(history[s], WINDOWS)[:, i:])
    cells, _ = cache.groups.primary.table.seq_cells(ids[2])
    assert np.unique(cells // B).size == 1  # fewer tokens than a page: one, nobody else's decodes in it
    pages = [b.page for b in cache.step_groups(0, cache.groups.served_step(0)).batches()]
    assert any(pages) == (path == "paged")  # "auto" gathers rows this narrow (16 elements)


run_step = STACK.forward_parts  # one step over [(seq, x, first_pos), ...]; each part's rows


def close(a, b):
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4, rtol=1e-4)


# -- (d) load_seq places through the hook ---------------------------------------------------------


class Heard:
    """Records what the placement hook hears, and lets the next implementation answer."""

    def __init__(self):
        self.calls = []

    @hookimpl(tryfirst=True)
    def kvlayout_choose_cells(self, free, count, seq_ids, positions, prev_cells):
        self.calls.append((count, seq_ids.tolist(), positions.tolist(), prev_cells.tolist()))


def test_load_seq_places_through_the_hook_into_a_fresh_page(tmp_path):
    src = model_cache()
    src_bc = src.as_batch_control()
    s = src_bc.seq_new()
    run_step(src, [(s, STACK.tokens(10, seed=50), 0)])
    path = src.save_seq(s, tmp_path / "seq.safetensors")
    pm = make_plugin_manager()
    heard = Heard()
    pm.register(heard)
    dst = CellCache(model_cache().config, pm)
    dst_bc = dst.as_batch_control()
    a = dst_bc.seq_new()
    run_step(dst, [(a, STACK.tokens(3, seed=51), 0)])  # page 0, partly
    loaded = dst.load_seq(path)
    cells, pos = dst.groups.primary.table.seq_cells(loaded)
    assert heard.calls[-1] == (10, [loaded] * 10, list(range(10)), [-1] * 10)  # the id it was about to get
    assert cells.tolist() == list(range(B, B + 10)) and pos.tolist() == list(range(10))  # a page of its own
    assert dst.groups.primary.table.newest_cells(np.array([loaded])).tolist() == [B + 9]  # where it continues


def test_a_restored_cache_continues_each_sequence_where_it_left_off(tmp_path):
    import kvlayout

    cache = model_cache()
    bc = cache.as_batch_control()
    a, b = bc.seq_new(), bc.seq_new()
    run_step(cache, [(a, STACK.tokens(5, seed=60), 0), (b, STACK.tokens(3, seed=61), 0)])
    fork = bc.seq_clone(a, upto=4)
    restored = kvlayout.load(cache.save(tmp_path / "cache.safetensors"))
    ids = np.array([a, b, fork])
    for got, want in zip(restored.groups.steppers, cache.groups.steppers, strict=True):  # in every layer group
        assert got.table.newest_cells(ids).tolist() == want.table.newest_cells(ids).tolist()
    assert restored.groups.primary.table.newest_cells(ids).tolist() == [4, B + 2, 3]
