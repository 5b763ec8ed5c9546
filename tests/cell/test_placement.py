"""Where a step's tokens land and what each one sees (the issue's numbered cases)."""

from __future__ import annotations

import pytest

from kvlayout.errors import StepError
from tests.cell.support import fill, rows, snapshot, step, stepper


def test_a_prefill_takes_the_lowest_cells_and_sees_itself_causally():
    t = stepper()
    s0 = t.seq_new()
    st = fill(t, s0, range(4))
    assert st.cells.tolist() == [0, 1, 2, 3]
    assert st.read_len == 4
    assert rows(st.mask) == ["1...", "11..", "111.", "1111"]
    st = fill(t, s0, [4])
    assert st.cells.tolist() == [4]
    assert rows(st.mask) == ["11111"]


def test_a_second_sequence_lands_after_the_first_and_sees_only_its_own_cells():
    t = stepper()
    s0, s1 = t.seq_new(), t.seq_new()
    fill(t, s0, range(4))
    st = fill(t, s1, range(2))
    assert st.cells.tolist() == [4, 5]
    assert st.read_len == 6
    assert rows(st.mask) == ["....1.", "....11"]


def test_two_sequences_prefilled_in_one_step_see_only_themselves():
    t = stepper()
    s0, s1 = t.seq_new(), t.seq_new()
    st = step(t, [(s0, 0), (s0, 1), (s0, 2), (s1, 0), (s1, 1)])
    assert st.cells.tolist() == [0, 1, 2, 3, 4]
    assert rows(st.mask) == ["1....", "11...", "111..", "...1.", "...11"]


def test_a_decode_and_a_prefill_share_one_step():
    t = stepper()
    s0, s1 = t.seq_new(), t.seq_new()
    fill(t, s0, range(2))
    st = step(t, [(s0, 2), (s1, 0), (s1, 1)])
    assert st.cells.tolist() == [2, 3, 4]
    assert rows(st.mask) == ["111..", "...1.", "...11"]
    assert (t.table.next_pos(s0), t.table.next_pos(s1)) == (3, 2)


def test_a_stale_position_is_refused_and_the_corrected_retry_needs_no_new_declaration():
    t = stepper()
    s0, s1 = t.seq_new(), t.seq_new()
    step(t, [(s0, 0), (s1, 0)])
    assert t.declare_step([s0, s1])
    before = snapshot(t)
    with pytest.raises(StepError, match=r"positions\[1\]=0 for sequence 1: expected a position newer than 0"):
        t.place_step(0, [1, 0])
    assert snapshot(t) == before
    st = t.place_step(0, [1, 1])
    # s1 continues after its cell 1; s0's next cell is s1's and the table is smaller than a page: the lowest free
    assert st.cells.tolist() == [3, 2]
    assert rows(st.mask) == ["1..1", ".11."]


def test_later_layers_reuse_the_placement_and_a_layer_served_twice_is_refused():
    t = stepper()
    s0 = t.seq_new()
    assert t.declare_step([s0, s0])
    first = t.place_step(0, [0, 1])
    second = t.place_step(1, [0, 1])
    assert second is first  # same window: one memoized step
    assert second.cells.tolist() == [0, 1]
    before = snapshot(t)
    with pytest.raises(StepError, match="layer 0 was already served in this step"):
        t.place_step(0, [0, 1])
    assert snapshot(t) == before
    assert t.table.free_cells == 14


def test_a_later_layer_with_other_positions_is_refused():
    t = stepper()
    s0 = t.seq_new()
    assert t.declare_step([s0, s0])
    t.place_step(0, [0, 1])
    with pytest.raises(StepError, match="differ from the step's"):
        t.place_step(1, [0, 2])
    assert t.place_step(1, [0, 1]).cells.tolist() == [0, 1]


def test_a_ring_layer_sees_only_its_window_of_each_sequence():
    t = stepper(windows=(2, 2))
    s0, s1 = t.seq_new(), t.seq_new()
    fill(t, s0, range(3))
    st = step(t, [(s1, 0), (s0, 3)])
    assert st.cells.tolist() == [4, 3]  # s0 continues after its cell 2 first; s1 takes the lowest left
    assert rows(st.mask) == ["....1", "..11."]


@pytest.mark.parametrize(
    "window, positions, last_row",
    [(4, [0, 1, 2, 3], "1111"), (3, [0, 1, 2, 3], ".111"), (2, [0, 5], ".1"), (8, [0, 5], "11")],
)
def test_the_window_bounds_how_old_a_visible_cell_may_be(window, positions, last_row):
    t = stepper(windows=(window,))
    s0 = t.seq_new()
    for p in positions:  # one token per step, so each row is a decode
        st = fill(t, s0, [p])
    assert rows(st.mask)[-1] == last_row


def test_layers_of_different_windows_get_their_own_masks_over_one_placement():
    t = stepper(windows=(0, 2, 0))
    s0 = t.seq_new()
    assert t.declare_step([s0] * 4)
    flat, ring, flat_again = (t.place_step(layer, range(4)) for layer in range(3))
    assert flat_again is flat and ring is not flat
    assert ring.cells.tolist() == flat.cells.tolist() == [0, 1, 2, 3]
    assert rows(flat.mask) == ["1...", "11..", "111.", "1111"]
    assert rows(ring.mask) == ["1...", "11..", ".11.", "..11"]


def test_a_freed_cell_refills_below_live_ones_and_the_mask_follows_positions():
    t = stepper()
    s0, s1 = t.seq_new(), t.seq_new()
    fill(t, s0, range(4))
    t.seq_rm(s0, 0, 2)
    st = step(t, [(s1, 0), (s1, 1), (s0, 4)])
    assert st.cells.tolist() == [0, 1, 4]  # s0 continues after its cell 3; s1, new, refills the lowest
    assert rows(st.mask) == ["1....", "11...", "..111"]
    st = fill(t, s1, [2])
    assert st.cells.tolist() == [5]  # 2 is s0's: s1 has no page to continue in, 5 is the lowest free
    assert rows(st.mask) == ["11...1"]
