"""The hookspecs through a real plugin manager: signatures, firstresult, observers.

kvlayout_builders is exercised through real entry points in test_registry.py;
here the CellStepper seams are called the way a cell layout calls them.
"""

from __future__ import annotations

import numpy as np
import pluggy
import pytest

from kvlayout import CellStep, hookimpl
from kvlayout.registry import make_plugin_manager


class LowestFree:
    """What the cell plugin ships: the lowest free cells, tried last."""

    @hookimpl(trylast=True)
    def kvlayout_choose_cells(self, free, count):
        return free[:count]


class HighestFree:
    @hookimpl
    def kvlayout_choose_cells(self, free, count):
        return free[::-1][:count]


class Abstains:
    def __init__(self):
        self.asked = []

    @hookimpl
    def kvlayout_choose_cells(self, free, count):
        self.asked.append(count)
        return None


class Recorder:
    def __init__(self):
        self.seen = []

    @hookimpl
    def kvlayout_step_placed(self, step, window):
        self.seen.append((step, window))
        return "ignored"


@pytest.fixture
def pm():
    return make_plugin_manager(entry_points=False)


FREE = np.array([2, 3, 7, 9, 12])


def test_choose_cells_is_firstresult_and_the_trylast_default_loses(pm):
    assert pm.hook.kvlayout_choose_cells.spec.opts["firstresult"] is True
    pm.register(LowestFree())
    assert pm.hook.kvlayout_choose_cells(free=FREE, count=2).tolist() == [2, 3]
    pm.register(HighestFree())  # registered later, but the default is trylast either way
    assert pm.hook.kvlayout_choose_cells(free=FREE, count=2).tolist() == [12, 9]


def test_choose_cells_skips_a_policy_that_answers_none(pm):
    abstains = Abstains()
    pm.register(LowestFree())
    pm.register(abstains)
    assert pm.hook.kvlayout_choose_cells(free=FREE, count=3).tolist() == [2, 3, 7]
    assert abstains.asked == [3]


def test_choose_cells_with_no_plugin_answers_none(pm):
    assert pm.hook.kvlayout_choose_cells(free=FREE, count=1) is None


def test_step_placed_reaches_every_observer(pm):
    first, second = Recorder(), Recorder()
    pm.register(first)
    pm.register(second)
    step = CellStep(length=2, read_len=3, cells=np.array([0, 2], np.int32), mask=np.ones((2, 3), bool))
    pm.hook.kvlayout_step_placed(step=step, window=4)
    assert first.seen == [(step, 4)] and second.seen == [(step, 4)]
    assert pm.hook.kvlayout_step_placed.spec.opts["firstresult"] is False


def test_an_implementation_with_an_argument_the_spec_lacks_is_refused(pm):
    class Wrong:
        @hookimpl
        def kvlayout_choose_cells(self, free, n):
            return free[:n]

    with pytest.raises(pluggy.PluginValidationError):
        pm.register(Wrong())


def test_an_implementation_may_take_fewer_arguments(pm):
    class OnlyWindow:
        def __init__(self):
            self.windows = []

        @hookimpl
        def kvlayout_step_placed(self, window):
            self.windows.append(window)

    plugin = OnlyWindow()
    pm.register(plugin)
    pm.hook.kvlayout_step_placed(step=None, window=0)
    assert plugin.windows == [0]


def test_kvlayout_builders_results_are_collected_from_every_plugin(pm):
    class A:
        @hookimpl
        def kvlayout_builders(self):
            return ["a"]

    class B:
        @hookimpl
        def kvlayout_builders(self):
            return ["b1", "b2"]

    pm.register(A())
    pm.register(B())
    assert sorted(pm.hook.kvlayout_builders()) == [["a"], ["b1", "b2"]]
