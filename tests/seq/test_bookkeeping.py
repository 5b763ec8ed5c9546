"""The neutral bookkeeping: runs, masks, floors, worked out by hand."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvlayout import KVLayoutError, StepError
from kvlayout.spec import MaskKind
from kvlayout_seq.bookkeeping import Run, SeqBook, SeqStepPlan, band_mask
from tests.seq.support import rows


def fill(book: SeqBook, n: int, chunk: int = 1) -> None:
    """Commit positions [length, length + n) in steps of `chunk`, as a forward would."""
    end = book.length + n
    while book.length < end:
        t = min(chunk, end - book.length)
        book.commit(book.plan(0, book.length, t))


def test_band_mask_t3_s5_w3_is_a_diagonal_band_of_three():
    assert rows(band_mask(3, 5, 3)) == ["11100", "01110", "00111"]


def test_band_mask_t3_s5_w5_is_lower_right_causal():
    assert rows(band_mask(3, 5, 5)) == ["11100", "11110", "11111"]


def test_flat_step_writes_one_run_at_its_start_and_reads_everything_before_its_end():
    book = SeqBook(32, [("flat", 0)])
    fill(book, 5)
    plan = book.plan(0, 5, 3)
    assert plan.writes == (Run(5, 3),)
    assert plan.reads == (Run(0, 8),)
    assert (plan.read_start, plan.mask_kind, plan.window) == (0, MaskKind.CAUSAL, 0)


def test_single_token_needs_no_mask_on_either_policy():
    book = SeqBook(32, [("flat", 0), ("ring", 4)])
    fill(book, 9)
    assert book.plan(0, 9, 1).mask_kind is MaskKind.NONE
    assert book.plan(1, 9, 1).mask_kind is MaskKind.NONE


def test_ring_w4_max_write_2_pair_at_4_wraps_its_write_and_reads_one_run_of_the_mirror():
    # 5 slots; positions 4, 5 -> slots 4, 0 (and 9, 5 in the mirror); keys 1..5 -> slots 1..5.
    book = SeqBook(32, [("ring", 4)], max_write=2)
    fill(book, 4)
    plan = book.plan(0, 4, 2)
    assert plan.writes == (Run(4, 1), Run(0, 1)) and plan.mirror == 5
    assert plan.reads == (Run(1, 5),)
    assert (plan.read_start, plan.read_len, plan.mask_kind) == (1, 5, MaskKind.EXPLICIT)


def test_ring_pair_at_0_is_causal():
    book = SeqBook(32, [("ring", 4)], max_write=2)
    plan = book.plan(0, 0, 2)
    assert (plan.writes, plan.reads, plan.mask_kind) == ((Run(0, 2),), (Run(0, 2),), MaskKind.CAUSAL)


def test_unset_max_write_gives_each_ring_its_window_and_the_narrowest_bounds_every_step():
    book = SeqBook(32, [("flat", 0), ("ring", 4), ("ring", 6)])
    assert [p.max_write for p in book.policies if p.kind == "ring"] == [4, 6]
    assert [p.slots for p in book.policies if p.kind == "ring"] == [7, 11]
    assert book.plan(2, 0, 4).length == 4
    for layer in range(3):  # the ring of window 4 could not take 5, so no layer does
        with pytest.raises(StepError, match="5 token.*max_write=4"):
            book.plan(layer, 0, 5)


def test_ring_slots_never_exceed_the_capacity():
    book = SeqBook(6, [("ring", 4)])  # 4 + 4 - 1 = 7 slots would be more than any position needs
    assert book.policies[0].slots == 6


def test_layers_with_the_same_kind_and_window_share_one_policy():
    book = SeqBook(32, [("ring", 4), ("flat", 0), ("ring", 4), ("ring", 3), ("flat", 0)])
    assert book.layers[0] is book.layers[2]
    assert book.layers[1] is book.layers[4]
    assert len(book.policies) == 3


def test_planning_changes_nothing():
    book = SeqBook(32, [("ring", 4)], max_write=2)
    fill(book, 6)
    before = (book.length, book.floor, book.policies[0].retained)
    assert book.plan(0, 6, 2) == book.plan(0, 6, 2)
    assert (book.length, book.floor, book.policies[0].retained) == before


def test_committing_the_same_step_from_every_layer_is_idempotent():
    book = SeqBook(32, [("flat", 0), ("ring", 4), ("ring", 4)], max_write=2)
    fill(book, 8, chunk=2)
    plans = [book.plan(layer, 8, 2) for layer in range(3)]
    book.commit(plans[0])
    after_one = (book.length, book.floor)
    for plan in plans[1:]:
        assert plan.start == 8  # later layers rewrite the positions the first one committed
        book.commit(plan)
    assert (book.length, book.floor) == after_one == (10, 8)


def test_can_extend_counts_against_capacity():
    book = SeqBook(32, [("flat", 0)])
    fill(book, 30)
    assert book.can_extend() and book.can_extend(2)
    assert not book.can_extend(3)


def test_flat_plus_ring4_at_length_10_rewinds_to_6_but_not_5_or_11():
    book = SeqBook(32, [("flat", 0), ("ring", 4)])
    fill(book, 10)
    assert not book.rewind(5)
    assert not book.rewind(11)
    assert book.length == 10
    assert book.rewind(6)
    assert book.length == 6


def test_a_second_rewind_cannot_reach_below_what_the_ring_still_holds():
    # After rewind(6) the ring holds positions 3..5 only: 2 and below were reused by 7..9.
    book = SeqBook(32, [("flat", 0), ("ring", 4)])
    fill(book, 10)
    assert book.rewind(6)
    assert not book.rewind(5)
    assert book.length == 6


def test_a_ring_with_max_write_1_rewinds_no_further_than_one_token():
    # 4 slots hold positions 6..9; a token at 8 would need 5, already reused by 9.
    book = SeqBook(32, [("ring", 4)], max_write=1)
    fill(book, 10)
    assert not book.rewind(8)
    assert book.rewind(9)


def test_a_ring_before_its_first_lap_rewinds_to_zero():
    book = SeqBook(32, [("ring", 4)])  # 7 slots, 5 positions: nothing reused yet
    fill(book, 5)
    assert book.rewind(0)


def test_a_wrapped_ring_still_rewinds_to_empty_as_clear_does():
    book = SeqBook(32, [("flat", 0), ("ring", 4)], max_write=1)
    fill(book, 10)  # the ring reused slots: nothing below 9 can be rewound to
    assert not book.rewind(1) and book.length == 10
    assert book.rewind(0)
    assert (book.length, book.floor, book.policies[1].retained) == (0, 0, 0)


def test_flat_only_rewinds_anywhere_up_to_the_length():
    book = SeqBook(32, [("flat", 0)])
    fill(book, 10)
    assert book.rewind(10) and book.rewind(0)


def test_clear_returns_to_length_zero_and_forgets_ring_reuse():
    book = SeqBook(32, [("ring", 4)], max_write=1)
    fill(book, 10)
    book.clear()
    assert (book.length, book.floor, book.policies[0].retained) == (0, 0, 0)
    assert book.can_extend(32)


@pytest.mark.parametrize("bad", [1.0, True, -1, None])
def test_rewind_and_can_extend_refuse_a_count_that_is_not_a_nonnegative_integer(bad):
    book = SeqBook(32, [("flat", 0)])
    fill(book, 4)
    with pytest.raises(KVLayoutError, match="new_len"):
        book.rewind(bad)
    with pytest.raises(KVLayoutError, match="n="):
        book.can_extend(bad)
    assert book.length == 4


def test_bookkeeping_imports_without_mlx():
    code = "import sys, kvlayout_seq.bookkeeping; assert 'mlx' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_book_without_layers_is_refused():
    with pytest.raises(KVLayoutError, match="policies"):
        SeqBook(32, [])


def test_seq_step_plan_end_and_read_len_sum_its_runs():
    plan = SeqStepPlan(
        start=10, length=3, writes=(Run(6, 2), Run(0, 1)), reads=(Run(5, 3), Run(0, 2)),
        read_start=6, mask_kind=MaskKind.EXPLICIT, window=5,
    )
    assert plan.end == 13
    assert plan.read_len == 5
    assert SeqStepPlan(0, 0, (), (), 0, MaskKind.NONE).read_len == 0


def test_seq_plan_records_are_frozen():
    for record, field in ((Run(slot=4, length=2), "slot"),
                          (SeqStepPlan(3, 2, (Run(3, 2),), (Run(0, 5),), 0, MaskKind.CAUSAL), "start")):
        with pytest.raises(AttributeError):
            setattr(record, field, 0)


def test_open_step_names_the_layers_a_begun_forward_has_not_written():
    book = SeqBook(16, [("flat", 0), ("ring", 4), ("flat", 0)])
    assert book.open_step() is None
    plan = book.plan(0, 0, 3)
    book.commit(plan, 0)
    assert book.open_step() == (0, [1, 2])
    book.commit(book.plan(2, 0, 3), 2)
    assert book.open_step() == (0, [1])
    book.commit(book.plan(1, 0, 3), 1)
    assert book.open_step() is None  # every layer wrote it: nothing to undo
