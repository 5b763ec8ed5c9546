"""The layout's own default placement, when it is the only one registered, is called without pluggy:
it must answer what the hook answers, and any other placement plugin (or wrapper) takes the hook again."""

from __future__ import annotations

import numpy as np
import pytest

from kvlayout import hookimpl
from kvlayout.errors import PluginStepError
from kvlayout.registry import make_plugin_manager, sole_implementation
from kvlayout_cell import placement
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
    assert sole_implementation(pm, HOOK) is placement.choose_cells
    lowest = LowestFree()
    pm.register(lowest)
    assert sole_implementation(pm, HOOK) is None  # two placements: the hook decides
    pm.unregister(lowest)
    assert sole_implementation(pm, HOOK) is placement.choose_cells
    wrapper = PassThrough()
    pm.register(wrapper)
    assert sole_implementation(pm, HOOK) is None  # a wrapper hears every call
    pm.unregister(wrapper)
    assert sole_implementation(pm, HOOK) is placement.choose_cells
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
    return placed


def test_the_direct_call_places_every_step_as_the_hook_does():
    direct = stepper(capacity=64)
    pm = make_plugin_manager()
    counted = PassThrough()
    pm.register(counted)  # same default rule, reached through pluggy and the referee
    hooked = stepper(capacity=64, pm=pm)
    placed = drive(direct)
    assert placed == drive(hooked) and len(placed) == 8
    assert counted.calls == 8  # the hooked table went through the hook at every placement


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
    assert table.declare_step([s])
    named = "plugin 'cell'.*kvlayout_choose_cells raised RuntimeError: placement bug"
    with pytest.raises(PluginStepError, match=named):
        table.place_step(0, [2])
    assert np.array_equal(table.table.free_list(), free) and table.table.held([s]).tolist() == [2]
    monkeypatch.undo()
    table.place_step(0, [2])  # the declaration stood: the corrected retry places it
    assert table.place_step(1, [2]).cells.tolist() == [2]
