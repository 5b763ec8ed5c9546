"""Sequence verbs: ids, forks that share cells, and removal that frees them."""

from __future__ import annotations

import numpy as np
import pytest

from kvlayout.errors import SequenceError, StepError
from tests.cell.support import fill, rows, snapshot, step, stepper


def test_a_fork_shares_every_cell_until_both_owners_are_gone():
    t = stepper()
    s0 = t.seq_new()
    fill(t, s0, range(4))
    fork = t.seq_clone(s0)
    assert t.table.free_cells == 12
    assert (t.table.seq_len(fork), t.table.next_pos(fork)) == (4, 4)
    t.seq_rm(s0)
    assert t.table.free_cells == 12 and t.table.used_end == 4
    assert (t.table.seq_len(s0), t.table.seq_len(fork)) == (0, 4)
    t.seq_rm(fork)
    assert t.table.free_cells == 16 and t.table.used_end == 0


def test_a_fork_at_upto_claims_only_the_prefix():
    t = stepper()
    s0 = t.seq_new()
    fill(t, s0, range(4))
    fork = t.seq_clone(s0, upto=2)
    assert (t.table.seq_len(fork), t.table.next_pos(fork)) == (2, 2)
    t.seq_rm(s0, 0, 2)
    assert t.table.free_cells == 12  # the fork still holds positions 0 and 1
    assert (t.table.seq_len(s0), t.table.next_pos(s0)) == (2, 4)


def test_a_fork_and_its_trunk_continue_apart():
    t = stepper()
    s0 = t.seq_new()
    fill(t, s0, range(3))
    fork = t.seq_clone(s0)
    st = step(t, [(s0, 3), (fork, 3)])
    assert st.cells.tolist() == [3, 4]
    assert rows(st.mask) == ["1111.", "111.1"]


def test_ids_are_handed_out_lowest_first_and_an_emptied_id_is_released():
    t = stepper()
    assert (t.seq_new(), t.seq_new()) == (0, 1)
    t.seq_rm(0)  # owns no cell: released
    assert t.seq_new() == 0
    ids = [t.seq_new() for _ in range(62)]
    assert ids == list(range(2, 64))
    assert t.seq_new() is None
    t.clear()
    assert t.seq_new() == 0


def test_an_id_stays_live_while_it_owns_a_cell():
    t = stepper()
    s0 = t.seq_new()
    fill(t, s0, range(3))
    t.seq_rm(s0, 0, 2)
    assert t.seq_new() == 1
    t.seq_rm(s0, 2)
    assert t.seq_new() == 0


def only_their_own(cells, read_len):
    """bool [T, read_len]: token i sees cells[i] alone."""
    mask = np.zeros((len(cells), read_len), dtype=bool)
    mask[np.arange(len(cells)), cells] = True
    return mask


def test_two_hundred_sequences_each_see_only_their_own_cell():
    t = stepper(capacity=256, max_seqs=200)
    ids = [t.seq_new() for _ in range(200)]
    assert ids == list(range(200)) and t.seq_new() is None
    assert t.declare_step(ids)
    st = t.place_step(0, [0] * 200)
    assert st.mask.shape == (200, 200)
    assert np.array_equal(st.mask, only_their_own(st.cells, 200))


def test_a_thousand_sequences_fit_in_one_table():
    t = stepper(capacity=1024, max_seqs=1000)
    ids = [t.seq_new() for _ in range(1000)]
    assert ids[-1] == 999 and t.seq_new() is None
    assert t.declare_step(ids)
    st = t.place_step(0, [0] * 1000)
    assert np.array_equal(st.mask, only_their_own(st.cells, 1000))
    t.place_step(1, [0] * 1000)  # the forward's last layer
    t.seq_rm(999)
    fork = t.seq_clone(998)
    assert fork == 999 and t.table.seq_len(fork) == 1
    shared = int(t.table.seq_cells(998)[0][0])
    st = step(t, [(998, 1), (999, 1)])
    # each sees the shared cell and its own new one
    mine, theirs = st.cells.tolist(), st.cells.tolist()[::-1]
    assert [r[shared] for r in rows(st.mask)] == ["1", "1"]
    assert [(r[c], r[o]) for r, c, o in zip(rows(st.mask), mine, theirs)] == [("1", "."), ("1", ".")]


def test_removing_the_middle_and_the_tail_keeps_length_and_next_position_current():
    t = stepper()
    s0 = t.seq_new()
    fill(t, s0, range(5))
    t.seq_rm(s0, 0, 2)
    assert (t.table.seq_len(s0), t.table.free_cells, t.table.next_pos(s0)) == (3, 13, 5)
    t.seq_rm(s0, 4, None)
    assert (t.table.seq_len(s0), t.table.next_pos(s0)) == (2, 4)
    assert t.table.used_end == 4


def test_after_removing_the_tail_only_newer_positions_are_accepted():
    t = stepper()
    s0 = t.seq_new()
    fill(t, s0, range(4))
    t.seq_rm(s0, 3, None)
    assert t.declare_step([s0])
    with pytest.raises(StepError, match="expected a position newer than 2"):
        t.place_step(0, [0])
    assert t.place_step(0, [3]).cells.tolist() == [3]


def test_used_end_shrinks_past_every_freed_tail_cell():
    t = stepper()
    a, b = t.seq_new(), t.seq_new()
    fill(t, a, range(2))
    fill(t, b, range(3))
    fill(t, a, [2])
    assert t.table.used_end == 6
    t.seq_rm(a, 2)  # frees cell 5; b's cells end at 5
    assert t.table.used_end == 5
    t.seq_rm(b)
    assert t.table.used_end == 2


@pytest.mark.parametrize("bad", [-1, 64, 1000])
def test_an_id_out_of_range_is_refused_by_every_verb(bad):
    t = stepper()
    s0 = t.seq_new()
    fill(t, s0, range(2))
    before = snapshot(t)
    calls = [
        lambda: t.table.seq_len(bad),
        lambda: t.table.next_pos(bad),
        lambda: t.seq_clone(bad),
        lambda: t.seq_rm(bad),
        lambda: t.declare_step([s0, bad]),
    ]
    for call in calls:
        with pytest.raises(SequenceError, match=rf"={bad}: expected an id in \[0, 64\)"):
            call()
    assert snapshot(t) == before


def test_an_id_not_live_answers_zero_but_cannot_be_acted_on():
    t = stepper()
    s0 = t.seq_new()
    fill(t, s0, range(2))
    before = snapshot(t)
    assert (t.table.seq_len(5), t.table.next_pos(5)) == (0, 0)
    for call in (lambda: t.seq_clone(5), lambda: t.seq_rm(5), lambda: t.declare_step([5])):
        with pytest.raises(SequenceError, match="=5: expected a live sequence"):
            call()
    assert snapshot(t) == before


@pytest.mark.parametrize("kwargs", [dict(p0=-1), dict(p0=3, p1=2), dict(p0=1.0), dict(p1=True)])
def test_a_malformed_range_is_refused_and_changes_nothing(kwargs):
    t = stepper()
    s0 = t.seq_new()
    fill(t, s0, range(4))
    before = snapshot(t)
    with pytest.raises(SequenceError, match=r"p[01]="):
        t.seq_rm(s0, **kwargs)
    assert snapshot(t) == before


def test_a_clone_with_no_id_left_is_none_and_changes_nothing():
    t = stepper(max_seqs=2)
    s0, _ = t.seq_new(), t.seq_new()
    fill(t, s0, range(2))
    before = snapshot(t)
    assert t.seq_clone(s0) is None
    assert snapshot(t) == before


def test_sequences_sharing_a_prefix_may_together_hold_more_than_capacity():
    t = stepper(capacity=4)
    s0 = t.seq_new()
    fill(t, s0, range(4))
    forks = [t.seq_clone(s0) for _ in range(3)]
    assert sum(t.table.seq_len(s) for s in [s0, *forks]) == 16 and t.table.free_cells == 0
