"""The layout's own default placement, when it is the only one registered, is called without pluggy:
it must answer what the hook answers, and any other placement plugin (or wrapper) takes the hook again."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlayout import hookimpl
from kvlayout.errors import PluginStepError, StepError
from kvlayout.registry import make_plugin_manager, sole_implementation
from kvlayout_cell import placement
from kvlayout_cell.placement import continue_each, own_pages
from kvlayout_cell.plugin import LowestFree
from tests.cell.support import stepper

HOOK = "kvlayout_choose_cells"


class PassThrough:
    """A wrapper that changes no answer, only counts the hook's calls: the hook's path, observed."""

    def __init__(self):
        self.calls = 0

    @hookimpl(wrapper=True)
    def kvlayout_choose_cells(self):
        self.calls += 1
        return (yield)


def test_the_sole_implementation_is_the_defaults_until_another_placement_or_wrapper_registers():
    pm = make_plugin_manager()
    assert sole_implementation(pm, HOOK) is placement.kvlayout_choose_cells
    lowest = LowestFree()
    pm.register(lowest)
    assert sole_implementation(pm, HOOK) is None  # two placements: the hook decides
    pm.unregister(lowest)
    assert sole_implementation(pm, HOOK) is placement.kvlayout_choose_cells
    wrapper = PassThrough()
    pm.register(wrapper)
    assert sole_implementation(pm, HOOK) is None  # a wrapper hears every call
    pm.unregister(wrapper)
    assert sole_implementation(pm, HOOK) is placement.kvlayout_choose_cells
    assert sole_implementation(pm, "kvlayout_step_placed") is None  # nobody observes


def drive(table) -> list[list[int]]:
    """Prompts of three sequences, a fork, a removal and decode steps: the cells of every placement."""
    ids = [table.seq_new() for _ in range(3)]
    placed, lengths = [], dict.fromkeys(ids, 0)

    def run(seqs, counts):
        tokens = [s for s, c in zip(seqs, counts) for _ in range(c)]
        positions = [lengths[s] + i for s, c in zip(seqs, counts) for i in range(c)]
        assert table.declare_step(tokens)
        steps = [table.place_step(layer, positions) for layer in range(table.n_layers)]
        placed.append(steps[0].cells.tolist())
        for s, c in zip(seqs, counts):
            lengths[s] += c

    run(ids, [5, 3, 7])
    for _ in range(4):
        run(ids, [1, 1, 1])
    fork = table.seq_clone(ids[1])
    lengths[fork] = lengths[ids[1]]
    table.seq_rm(ids[0])
    del lengths[ids[0]]
    for _ in range(3):
        run([ids[1], ids[2], fork], [1, 2, 1])
    for _ in range(130):  # past a page's end (PLACEMENT_PAGE = 128): each sequence takes a fresh page
        run([ids[2], fork], [1, 1])
    return placed


def test_the_direct_call_places_every_step_as_the_hook_does():
    direct = stepper(capacity=1024)
    pm = make_plugin_manager()
    counted = PassThrough()
    pm.register(counted)  # same default rule, reached through pluggy and the referee
    hooked = stepper(capacity=1024, pm=pm)
    placed = drive(direct)
    assert placed == drive(hooked) and len(placed) == 138
    assert counted.calls == 138  # the hooked table went through the hook at every placement


def test_a_default_that_raises_is_reported_through_the_hook_naming_the_plugin_and_changes_nothing(monkeypatch):
    table = stepper(capacity=32)
    s = table.seq_new()
    assert table.declare_step([s, s])
    table.place_step(0, [0, 1])
    table.place_step(1, [0, 1])
    free = table.table.free_list().copy()

    def broken(*args, **kwargs):
        raise RuntimeError("placement bug")

    monkeypatch.setattr(placement, "own_pages", broken)
    fresh = table.seq_new()  # its first token continues nothing: the whole rule runs, and raises
    assert table.declare_step([fresh])
    named = "plugin 'cell'.*kvlayout_choose_cells raised RuntimeError: placement bug"
    with pytest.raises(PluginStepError, match=named):
        table.place_step(0, [0])
    assert np.array_equal(table.table.free_list(), free) and table.table.held([s, fresh]).tolist() == [2, 0]
    monkeypatch.undo()
    table.place_step(0, [0])  # the declaration stood: the corrected retry places it
    assert table.place_step(1, [0]).cells.tolist() == [table.table.newest_cells(np.array([fresh])).item()]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_continuing_each_cell_is_own_pages_answer_whenever_it_answers(data):
    # continue_each asks a cell at a time what own_pages finds in the free list: on random tables, every
    # answer it gives is own_pages' (the oracle), and steps made to continue are answered.
    capacity = data.draw(st.integers(16, 300))
    page = data.draw(st.sampled_from([4, 8, 128]))
    occupied = set(data.draw(st.lists(st.integers(0, capacity - 1), max_size=capacity)))
    free = np.array(sorted(set(range(capacity)) - occupied), dtype=np.int64)
    continuing = sorted(c for c in occupied if (c + 1) % page and c + 1 < capacity and c + 1 not in occupied)
    ahead_free = sorted(c for c in occupied if c + 1 < capacity and c + 1 not in occupied)  # page ends too
    pick = data.draw(st.sampled_from(["continuing", "ahead free", "any"]))
    if pick == "continuing" and continuing:
        prev = data.draw(st.lists(st.sampled_from(continuing), min_size=1, max_size=8, unique=True))
    elif pick == "ahead free" and ahead_free:
        prev = data.draw(st.lists(st.sampled_from(ahead_free), min_size=1, max_size=8, unique=True))
    else:
        prev = data.draw(st.lists(st.integers(-1, capacity - 1), min_size=1, max_size=8))

    def is_free(cell):
        return 0 <= cell < capacity and cell not in occupied

    got = continue_each(prev, is_free, page)
    if set(prev) <= set(continuing) and len(set(prev)) == len(prev):
        assert got is not None  # a decode step of sequences continuing in their pages
    if got is not None:
        oracle = own_pages(free, np.arange(len(prev)), np.array(prev, dtype=np.int64), page)
        assert got == oracle.tolist()


def test_an_answer_asked_while_a_placement_registers_does_not_outlive_its_registration():
    # Another thread (a server stepping its engine) may ask between the plugin's registration and its guard's:
    # a property the registry reads while scanning the plugin asks at that very point.
    pm = make_plugin_manager()
    seen = []

    class Probe:
        @property
        def probe(self):
            seen.append(sole_implementation(pm, HOOK))
            return None

        @hookimpl
        def kvlayout_choose_cells(self, free, count):
            return free[:count]

    pm.register(Probe())
    assert placement.kvlayout_choose_cells in seen  # asked mid-registration, when only the default was in
    assert sole_implementation(pm, HOOK) is None  # and not kept past it: the new placement is heard


@pytest.mark.parametrize("lowest", [False, True])
def test_the_free_list_and_is_free_stay_true_through_decode_steps(lowest):
    # The oracle: every cell a step was given, in a plain set. A lowest-free placement's decode keeps the free
    # list as a view of the last (its head cut off, O(1)); the default's drops it and rebuilds it when asked.
    pm = make_plugin_manager()
    if lowest:
        pm.register(LowestFree())
    t = stepper(capacity=256, pm=pm)
    ids = [t.seq_new() for _ in range(8)]
    taken, lengths = set(), dict.fromkeys(ids, 0)
    for step in range(12):
        seqs = ids if step else [s for s in ids for _ in range(3)]
        positions = [lengths[s] + seqs[:i].count(s) for i, s in enumerate(seqs)]
        before = t.table.free_list()
        assert t.declare_step(seqs)
        cells = [t.place_step(layer, positions) for layer in range(t.n_layers)][0].cells.tolist()
        taken.update(cells)
        for s in seqs:
            lengths[s] += 1
        free = t.table.free_list()
        assert free.tolist() == [c for c in range(256) if c not in taken]
        assert [c for c in range(-2, 260) if t.table.is_free(c)] == free.tolist()
        if lowest and step:
            assert np.shares_memory(before, free)  # the head cut off, not the list copied


def test_a_plugin_module_may_import_the_default_rule_to_fall_back_on():
    # The rule is a plain function; only the plugin's own kvlayout_choose_cells is marked as the hook.
    import types

    module = types.ModuleType("falls_back")
    exec("from kvlayout_cell.placement import choose_cells, own_pages", module.__dict__)
    pm = make_plugin_manager()
    assert pm.register(module) == "falls_back"
    assert sole_implementation(pm, HOOK) is placement.kvlayout_choose_cells  # it implements nothing itself


def table_state(t) -> dict:
    """Everything a step may change, as plain lists: the oracle an aborted step must leave as it found."""
    table = t.table
    cells, positions, owners = table.occupied()
    ids = np.arange(table.max_seqs)
    live = table.live_ids()
    return {
        "cells": cells.tolist(), "positions": positions.tolist(), "owners": owners.tolist(),
        "held": table.held(ids).tolist(), "newest": table.newest_positions(ids).tolist(),
        "newest_cells": table.newest_cells(ids).tolist(), "used_end": table.used_end,
        "free": table.free_list().tolist(), "free_cells": table.free_cells,
        "keys": [a.tolist() for a in table.seq_keys(live)],
    }


@pytest.mark.parametrize("as_array", [False, True])
@pytest.mark.parametrize("capacity", [512, 2048])  # sequences sharing pages (placed whole), and a page each
def test_a_decode_step_settled_in_python_places_as_the_array_path_and_aborts_to_the_table_it_found(
        as_array, capacity):
    # The engine declares a decode step's ids as a list of ints (settled in Python: CellTable.occupy_few);
    # an array takes the array path. Both place the same cells, and aborting either, first layer served or
    # every layer, leaves every record of the table as it was (the oracle: the table read before the step).
    t, twin = stepper(capacity=capacity), stepper(capacity=capacity)
    ids = [t.seq_new() for _ in range(5)]
    assert [twin.seq_new() for _ in range(5)] == ids
    lengths = [3, 9, 1, 14, 6]
    for table in (t, twin):
        tokens = [s for s, n in zip(ids, lengths) for _ in range(n)]
        assert table.declare_step(tokens)
        positions = [i for n in lengths for i in range(n)]
        for layer in range(table.n_layers):
            table.place_step(layer, positions)
    for step in range(6):
        positions = [n + step for n in lengths]
        declared = np.array(ids) if as_array else list(ids)
        before = table_state(t)
        assert t.declare_step(declared) and twin.declare_step(np.array(ids))
        got = t.place_step(0, positions).cells.tolist()
        assert got == twin.place_step(0, positions).cells.tolist()
        if step % 2:  # aborted mid-forward, then after every layer: the same table either way
            if step == 3:
                t.place_step(1, positions)
            assert t.abort_step() and twin.abort_step()
            assert table_state(t) == before == table_state(twin)
            assert t.declare_step(declared) and twin.declare_step(np.array(ids))
            assert t.place_step(0, positions).cells.tolist() == got == twin.place_step(0, positions).cells.tolist()
        t.place_step(1, positions)
        twin.place_step(1, positions)
        assert table_state(t) == table_state(twin)


def test_a_decode_step_of_a_position_not_newer_is_refused_by_name_and_changes_nothing():
    # The oracle: a twin table given the same steps, without the refused one.
    t, twin = stepper(capacity=64), stepper(capacity=64)
    for table in (t, twin):
        ids = [table.seq_new() for _ in range(3)]
        assert table.declare_step([s for s in ids for _ in range(4)])
        for layer in range(table.n_layers):
            table.place_step(layer, [0, 1, 2, 3] * 3)
        assert table.declare_step(list(ids))
    before = table_state(t)
    with pytest.raises(StepError, match=r"positions\[1\]=3 for sequence 1: expected a position newer than 3"):
        t.place_step(0, [4, 3, 4])
    assert table_state(t) == before == table_state(twin)
    # The declaration stood: the corrected retry places what the twin does.
    assert t.place_step(0, [4, 4, 4]).cells.tolist() == twin.place_step(0, [4, 4, 4]).cells.tolist()
    assert table_state(t) == table_state(twin)
