"""The step protocol: declarations, refusals that change nothing, and the plugin seams."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from kvlayout import hookimpl
from kvlayout.errors import SequenceError, StepError
from kvlayout.registry import make_plugin_manager
from kvlayout_cell.plugin import LowestFree
from tests.cell.support import fill, rows, snapshot, stepper


def test_a_step_with_no_declaration_is_refused():
    t = stepper()
    t.seq_new()
    with pytest.raises(StepError, match=r"no step declared; expected declare_step\(seq_ids\) first"):
        t.place_step(0, [0])
    assert t.table.free_cells == 16


def test_a_token_count_differing_from_the_declaration_is_refused_and_the_declaration_stands():
    t = stepper()
    s0 = t.seq_new()
    assert t.declare_step([s0, s0])
    before = snapshot(t)
    with pytest.raises(StepError, match=r"3 position\(s\) for a step declared with 2 token\(s\)"):
        t.place_step(0, [0, 1, 2])
    assert snapshot(t) == before
    assert t.place_step(0, [0, 1]).cells.tolist() == [0, 1]


def test_positions_must_rise_within_a_step():
    t = stepper()
    s0 = t.seq_new()
    assert t.declare_step([s0, s0])
    with pytest.raises(StepError, match=r"positions\[1\]=0 for sequence 0"):
        t.place_step(0, [0, 0])
    with pytest.raises(StepError, match=r"positions\[0\]=-1: expected a position >= 0"):
        t.place_step(0, [-1, 0])
    assert t.place_step(0, [0, 1]).cells.tolist() == [0, 1]


@pytest.mark.parametrize(
    "positions", [[0.0, 1.0], [0, True], np.array([0, np.nan]), np.array([True, False]), [[0, 1]], ["a", "b"]]
)
def test_positions_that_are_not_integers_are_refused_by_name(positions):
    t = stepper()
    s0 = t.seq_new()
    assert t.declare_step([s0, s0])
    before = snapshot(t)
    with pytest.raises(StepError, match="^positions"):
        t.place_step(0, positions)
    assert snapshot(t) == before
    assert t.place_step(0, np.array([0, 1], dtype=np.int32)).cells.tolist() == [0, 1]


def test_ids_that_are_not_integers_are_refused_by_name():
    t = stepper()
    t.seq_new()
    for bad in ([0.0], [True], np.array([np.nan])):
        with pytest.raises(SequenceError, match="seq_ids"):
            t.declare_step(bad)
    with pytest.raises(SequenceError, match="seq_id="):
        t.table.seq_len(0.0)


def test_an_empty_declaration_is_refused():
    t = stepper()
    t.seq_new()
    with pytest.raises(StepError, match="expected at least one"):
        t.declare_step([])


def test_a_layer_out_of_range_is_refused():
    t = stepper()
    s0 = t.seq_new()
    assert t.declare_step([s0])
    with pytest.raises(StepError, match=r"layer=2: expected a layer in \[0, 2\)"):
        t.place_step(2, [0])
    assert t.place_step(1, [0]).cells.tolist() == [0]


def test_a_declaration_beyond_the_free_cells_is_false_and_leaves_the_last_one_standing():
    t = stepper(capacity=4)
    s0 = t.seq_new()
    fill(t, s0, [0])
    assert t.declare_step([s0] * 3)
    before = snapshot(t)
    assert not t.table.can_extend(4) and t.table.can_extend(3)
    assert t.declare_step([s0] * 4) is False
    assert snapshot(t) == before
    assert t.place_step(1, [1, 2, 3]).cells.tolist() == [1, 2, 3]  # the declaration still stands


def test_a_verb_between_layers_is_refused_and_the_forward_goes_on():
    t = stepper()
    s0 = t.seq_new()
    assert t.declare_step([s0, s0])
    t.place_step(0, [0, 1])
    before = snapshot(t)
    with pytest.raises(
        StepError, match=r"seq_new during a forward: layer\(s\) \[1\] of the placed step were not served"
    ):
        t.seq_new()
    assert snapshot(t) == before and t.unserved_layers() == [1]
    assert t.place_step(1, [0, 1]).cells.tolist() == [0, 1]
    assert t.seq_new() == 1  # the forward is complete: verbs go ahead, and end the step
    with pytest.raises(StepError, match=r"no step declared \(a verb since the last declaration ended that step\)"):
        t.place_step(1, [0, 1])


def test_a_verb_after_a_declaration_ends_it_and_is_no_declaration_itself():
    t = stepper()
    s0 = t.seq_new()
    fill(t, s0, range(2))
    assert t.declare_step([s0])
    t.seq_clone(s0)
    with pytest.raises(StepError, match="no step declared"):
        t.place_step(0, [2])


def test_a_new_declaration_is_refused_until_every_layer_served_the_step():
    t = stepper()
    s0 = t.seq_new()
    assert t.declare_step([s0])
    t.place_step(0, [0])
    before = snapshot(t)
    with pytest.raises(StepError, match=r"declare_step during a forward: layer\(s\) \[1\]"):
        t.declare_step([s0])
    assert snapshot(t) == before
    t.place_step(1, [0])
    assert t.declare_step([s0])
    assert t.place_step(0, [1]).cells.tolist() == [1]


class Answer:
    """A kvlayout_choose_cells policy that gives a fixed answer."""

    def __init__(self, answer):
        self.answer = answer

    @hookimpl
    def kvlayout_choose_cells(self, free, count):
        return self.answer


@pytest.mark.parametrize(
    "answer",
    [[0], [0, 0], [0, 1, 2], [5, 99], [0.0, 1.0], np.array([[0, 1]]), "no"],
    ids=["too-few", "repeated", "too-many", "out-of-range", "floats", "2-d", "not-cells"],
)
def test_a_bad_choose_cells_answer_is_refused_naming_it_and_changes_nothing(answer):
    pm = make_plugin_manager()
    pm.register(Answer(answer))
    t = stepper(pm=pm)
    s0 = t.seq_new()
    assert t.declare_step([s0, s0])
    before = snapshot(t)
    with pytest.raises(
        StepError, match=r"kvlayout_choose_cells answered .*: expected 2 distinct cells from the free list"
    ):
        t.place_step(0, [0, 1])
    assert snapshot(t) == before


def test_an_occupied_cell_is_a_bad_answer():
    pm = make_plugin_manager()
    policy = Answer(None)
    pm.register(policy)
    t = stepper(pm=pm)
    s0 = t.seq_new()
    fill(t, s0, range(2))
    policy.answer = [1, 2]
    assert t.declare_step([s0, s0])
    with pytest.raises(StepError, match=r"answered \[1, 2\]"):
        t.place_step(0, [2, 3])
    policy.answer = None  # fall through to the default: s0 continues after its cell 1
    assert t.place_step(0, [2, 3]).cells.tolist() == [2, 3]


def test_a_manager_where_no_plugin_chooses_cells_refuses_the_step():
    t = stepper(pm=make_plugin_manager(entry_points=False))
    s0 = t.seq_new()
    assert t.declare_step([s0])
    with pytest.raises(StepError, match="no plugin answered"):
        t.place_step(0, [0])
    assert t.table.free_cells == 16


def test_a_third_party_policy_wins_over_the_default_even_with_the_hooks_old_arguments():
    class HighestFirst:
        @hookimpl
        def kvlayout_choose_cells(self, free, count):  # written before seq_ids, positions, prev_cells
            return free[::-1][:count]

    pm = make_plugin_manager()
    pm.register(HighestFirst())
    t = stepper(pm=pm)
    s0 = t.seq_new()
    st = fill(t, s0, range(3))
    assert st.cells.tolist() == [15, 14, 13]
    assert st.read_len == 16


class Recorder:
    def __init__(self):
        self.calls = []

    @hookimpl
    def kvlayout_step_placed(self, step, window):
        self.calls.append((window, step))


def test_observers_hear_once_per_window_per_step():
    pm = make_plugin_manager()
    recorder = Recorder()
    pm.register(recorder)
    t = stepper(windows=(0, 2, 0, 2), pm=pm)
    s0 = t.seq_new()
    assert t.declare_step([s0, s0])
    served = [t.place_step(layer, [0, 1]) for layer in range(4)]
    assert [w for w, _ in recorder.calls] == [0, 2]
    assert recorder.calls[0][1] is served[0] is served[2]
    assert recorder.calls[1][1] is served[1] is served[3]
    fill(t, s0, [2])
    assert [w for w, _ in recorder.calls] == [0, 2, 0, 2]


def test_an_observer_cannot_change_a_shared_step():
    pm = make_plugin_manager()
    recorder = Recorder()
    pm.register(recorder)
    t = stepper(pm=pm)
    s0 = t.seq_new()
    fill(t, s0, range(2))
    _, st = recorder.calls[0]
    with pytest.raises(ValueError):
        st.mask[0, 1] = True
    with pytest.raises(ValueError):
        st.cells[0] = 7


class PlacementLedger:
    """A policy keeping its own record of occupied cells, as a paged allocator would."""

    def __init__(self):
        self.held, self.aborted = set(), []

    @hookimpl
    def kvlayout_step_placed(self, step, window):
        if window == 0:
            self.held |= set(step.cells.tolist())

    @hookimpl
    def kvlayout_step_aborted(self, step, window):
        self.aborted.append((window, step))
        if window == 0:
            self.held -= set(step.cells.tolist())


def test_an_aborted_step_is_announced_for_each_window_it_was_placed_for():
    pm = make_plugin_manager()
    ledger = PlacementLedger()
    pm.register(ledger)
    t = stepper(windows=(0, 2, 0), pm=pm)
    s0 = t.seq_new()
    fill(t, s0, range(3))  # a completed step stays in the ledger
    assert t.declare_step([s0, s0])
    served = [t.place_step(layer, [3, 4]) for layer in range(2)]  # layers 0 and 1 ran, then the forward failed
    assert ledger.held == {0, 1, 2, 3, 4}
    assert t.abort_step()
    assert [(w, st) for w, st in ledger.aborted] == [(0, served[0]), (2, served[1])]
    assert ledger.held == {0, 1, 2} == set(t.table.occupied()[0].tolist())
    assert not t.abort_step() and len(ledger.aborted) == 2  # nothing open: nothing announced


class SkipOne:
    """Skips the lowest free cell: the placement is not a head of the free list."""

    @hookimpl
    def kvlayout_choose_cells(self, free, count):
        return free[1 : count + 1]


class Highest:
    @hookimpl
    def kvlayout_choose_cells(self, free, count):
        return free[::-1][:count]


@pytest.mark.parametrize("policy", [None, SkipOne(), Highest()])
def test_the_free_list_after_placements_is_every_cell_no_token_holds(policy):
    pm = make_plugin_manager()
    if policy is not None:
        pm.register(policy)
    t = stepper(pm=pm)  # 16 cells
    a, b = t.seq_new(), t.seq_new()
    fill(t, a, range(3))
    fill(t, b, range(2))
    t.seq_rm(a, 1, 2)  # a hole
    fill(t, b, [2])
    held = set(t.table.occupied()[0].tolist())
    assert len(held) == 5 and t.table.free_list().tolist() == sorted(set(range(16)) - held)


# -- a mask read after its step ended is the step's, and only a step someone holds keeps a copy ------


def lowest_free_stepper(pm=None):
    """Two flat layers placing in the lowest free cells, so the cells below are worked by hand."""
    pm = make_plugin_manager() if pm is None else pm
    pm.register(LowestFree())
    return stepper(capacity=16, pm=pm)


def two_sequences_then_a_mixed_step(t, keep_step: bool):
    """a holds cells 0, 1 (positions 0, 1), b cell 2 (position 0); then a@2 and b@1 go to cells 3, 4,
    where a's token sees cells 0, 1, 3 and b's sees 2, 4; then a@3 goes to cell 5."""
    a, b = t.seq_new(), t.seq_new()
    fill(t, a, [0, 1])
    fill(t, b, [0])
    assert t.declare_step([a, b])
    held = t.place_step(0, [2, 1]) if keep_step else None  # kept or not; nobody reads the mask yet
    for layer in range(1 if keep_step else 0, 2):
        t.place_step(layer, [2, 1])
    fill(t, a, [3])
    return held


def test_a_mask_read_after_its_step_ended_is_the_one_placed():
    step = two_sequences_then_a_mixed_step(lowest_free_stepper(), keep_step=True)
    assert rows(step.mask) == ["11.1.", "..1.1"]  # not cell 5, a's since


def test_an_observer_holding_a_step_reads_its_mask_as_placed_too():
    pm = make_plugin_manager()
    recorder = Recorder()
    pm.register(recorder)
    two_sequences_then_a_mixed_step(lowest_free_stepper(pm), keep_step=False)
    (_, mixed), (_, later) = recorder.calls[2], recorder.calls[3]
    assert rows(mixed.mask) == ["11.1.", "..1.1"]
    assert rows(later.mask) == ["11.1.1"]


class HearsAborts:
    """Observes aborted steps only, reading each window's mask as it hears of it."""

    def __init__(self):
        self.masks = []

    @hookimpl
    def kvlayout_step_aborted(self, step, window):
        self.masks.append(rows(step.mask))


def test_an_abort_observer_reads_the_aborted_steps_mask_as_placed():
    # The observers hear of an abort once its cells are released: the mask they read is the step's.
    pm = make_plugin_manager()
    heard = HearsAborts()
    pm.register(heard)
    t = lowest_free_stepper(pm)
    a, b = t.seq_new(), t.seq_new()
    fill(t, a, [0, 1])
    fill(t, b, [0])
    assert t.declare_step([a, b])
    t.place_step(0, [2, 1])
    assert t.abort_step()
    assert heard.masks == [["11.1.", "..1.1"]]


def test_a_step_nobody_holds_keeps_no_copy_of_the_table(monkeypatch):
    # The copy is O(cells used) host time at every step's end; it is for a late reader only.
    t = lowest_free_stepper()
    copies = []
    real = t.table.snapshot
    monkeypatch.setattr(t.table, "snapshot", lambda copy=True: copies.append(copy) or real(copy))
    two_sequences_then_a_mixed_step(t, keep_step=False)
    assert True not in copies
    held = two_sequences_then_a_mixed_step(t, keep_step=True)  # held this time: copied once, when it ended
    assert copies.count(True) == 1 and held.mask.shape == (2, 11)


def test_a_later_layer_given_the_placing_positions_object_is_served_as_place_step_would():
    # serve_again (the cache's path for a forward's later layers) answers exactly where place_step would
    # answer the same step, and leaves every other case to place_step, which refuses it by name.
    from kvlayout.positions import StepPositions

    t = stepper(windows=(0, 0, 0))
    s0 = t.seq_new()
    assert t.declare_step([s0, s0])
    pos = StepPositions([0, 1])
    assert t.serve_again(1, pos) is None  # nothing placed yet
    first = t.place_step(0, pos)
    assert t.serve_again(0, pos) is None  # served already: place_step says so
    with pytest.raises(StepError, match="layer 0 was already served"):
        t.place_step(0, pos)
    assert t.serve_again(1, StepPositions([0, 1])) is None  # equal positions, another object: compared by place_step
    assert t.serve_again(3, pos) is None and t.serve_again(1.0, pos) is None  # out of range, not an int
    assert t.serve_again(1, pos) is first and t.unserved_layers() == [2]
    assert t.place_step(2, [0, 1]) is first and t.unserved_layers() == []
    assert t.seq_new() == 1  # a verb ends the step
    assert t.serve_again(1, pos) is None


@pytest.mark.parametrize("size", [0, 1, 2, 255, 256, 257, 1000])
def test_distinct_sorted_is_numpys_unique_on_either_side_of_the_python_path(size, rng):
    from kvlayout_cell.placement import FEW_IDS, distinct_sorted

    assert FEW_IDS == 256  # the sizes above straddle it
    for values in (rng.integers(0, 50, size), rng.permutation(size), np.arange(size)[::-1]):
        values = np.asarray(values, dtype=np.int64)
        got = distinct_sorted(values)
        assert got.dtype == np.int64 and np.array_equal(got, np.unique(values))


@pytest.mark.parametrize("make", [
    lambda ids: np.array(ids, dtype=np.int64),
    lambda ids: pickle.loads(pickle.dumps(np.array(ids, dtype=np.int64))),  # memory over bytes, yet writable
    list,
])
def test_a_declaration_keeps_its_own_ids_whatever_the_caller_does_with_theirs(make):
    t = stepper(capacity=1024, max_seqs=64)
    s = t.seq_new()
    ids = make([s] * 200)
    assert t.declare_step(ids)
    ids[:] = [5] * 200  # the caller reuses its buffer; id 5 is not live
    t.place_step(0, list(range(200)))
    assert t.table.live_ids().tolist() == [s] and t.table.seq_len(s) == 200 and t.table.seq_len(5) == 0
