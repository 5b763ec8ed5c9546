"""A decode step's grouping, continued from the step before instead of planned again.

Planning a step's groups (`kvlayout_cell.groups.plan_cells`) reads every cell
of the step's sequences and builds each batch's cells and mask on the host:
O(sequences x cells) numpy work and a few dozen numpy calls every step, then
a copy of those arrays to MLX. In steady decoding the next step is almost
the same plan: the same sequences, one token each at the next position, and
one new cell each. So when a step is exactly that continuation of the
planned one, and the table changed only by this step's own placement since,
each group's new cell is added to the previous plan on the device instead:

- a gathered batch (page 0): the cell goes at the group's next slot (one
  more column when a group is already at the batch's width); the mask
  shows each group's first `count` slots (None when every group fills the
  batch);
- a paged batch: a cell in one of the group's pages becomes visible there;
  any other cell is gathered at the end of the group's tail.

The result is the plan's grouping up to padding, and attention over it is
the dense mask's (each group still attends exactly its sequence's cells, a
decode token seeing all of its own on a flat layer). Which batch a group is
in, which pages are read in place and the grouped-or-dense choice stay as
the last full plan made them, which is why a full plan is made again every
`REPLAN_EVERY` steps. A few MLX operations per batch, whatever the lengths.

Only flat layers (window 0) with one-token groups in step order (`in_order`)
are continued; anything else, or a table changed by any verb, is planned whole.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np

from kvlayout.spec import AttendBatch, AttendGroups

_ONE_ON = (1).__add__  # a position one on, mapped in C over a step's positions
REPLAN_EVERY = 16  # continued steps before a full plan: it re-batches groups and re-chooses pages as they grow


@attrs.define(eq=False)
class BatchState:
    """One batch of a continued plan: its groups' token range, and per group the slots it fills."""

    first: int  # its groups are the step's tokens [first, first + len(counts))
    counts: np.ndarray  # [G_b]: cells gathered (a gathered batch's cells, a paged batch's tail)
    pages: np.ndarray | None = None  # [G_b, P]: a paged batch's pages, -1 where padding


@attrs.define(eq=False)
class Continuation:
    """A decode step's plan and what continuing it needs. `epoch`: the table's once the step was placed."""

    plan: AttendGroups
    batches: list[BatchState]
    seq_ids: list[int]  # the step's tokens' sequences and positions, as Python ints: compared every step,
    positions: tuple[int, ...]  # where numpy's comparisons run cold
    epoch: int
    slots: int
    steps: int = 0

    @classmethod
    def of(cls, plan: AttendGroups, host: AttendGroups, seq_ids: np.ndarray, positions: np.ndarray, epoch: int,
           slots: int) -> Continuation | None:
        """The continuation of a step planned whole: `plan` (MLX) and `host`, the same plan in numpy.
        None when it cannot be continued (groups of several tokens, or not in step order)."""
        if not host.in_order or any(b.tokens.shape[1] != 1 for b in host.batches()):
            return None
        batches, first = [], 0
        for b in host.batches():
            n_groups = b.tokens.shape[0]
            tail = 0 if b.tail is None else b.tail.shape[1]
            width = b.cells.shape[1] * max(b.page, 1) + tail  # slots: its cells', or its pages' then its tail's
            visible = np.ones((n_groups, width), dtype=bool) if b.mask is None else b.mask[:, 0, 0, :]  # [G, width]
            if not b.page:
                batches.append(BatchState(first, visible.sum(axis=1)))
            else:
                n_pages = b.cells.shape[1]
                held = visible[:, : n_pages * b.page].reshape(n_groups, n_pages, b.page).any(axis=2)  # [G, P]
                pages = np.where(held, b.cells, -1)
                batches.append(BatchState(first, visible[:, n_pages * b.page :].sum(axis=1), pages))
            first += n_groups
        return cls(plan, batches, seq_ids.tolist(), tuple(positions.tolist()), epoch, slots)

    def follows(self, seq_ids: list[int], positions: tuple[int, ...], epoch: int, slots: int) -> bool:
        """Whether a step of these tokens (as Python ints), placed at `epoch` over `slots` pool slots,
        continues this one: the same sequences in the same order, each one position on, and nothing but
        its own placement changed the table since."""
        return (self.steps < REPLAN_EVERY and epoch == self.epoch + 1 and slots == self.slots
                and seq_ids == self.seq_ids and positions == tuple(map(_ONE_ON, self.positions)))

    def advance(self, cells: np.ndarray, epoch: int) -> AttendGroups:
        """The plan of the step that `follows` this one, each token's new cell `cells` [T] added; this
        continuation then stands for that step."""
        batches = [_advance(b, s, cells[s.first : s.first + s.counts.size]) for b, s in
                   zip(self.plan.batches(), self.batches)]
        head, more = batches[0], tuple(batches[1:])
        self.plan = AttendGroups(head.tokens, head.cells, head.mask, self.plan.out, more=more, page=head.page,
                                 tail=head.tail, in_order=True)
        self.positions = tuple(map(_ONE_ON, self.positions))
        self.epoch = epoch
        self.steps += 1
        return self.plan


def _advance(b: AttendBatch, state: BatchState, new: np.ndarray) -> AttendBatch:
    """Batch `b` with each group's new cell `new` [G_b] added (`state` moved on with it)."""
    if not b.page:
        cells, mask = _gathered(b.cells, state.counts, new)
        return AttendBatch(b.tokens, cells, mask)
    page = b.page
    n_pages = b.cells.shape[1]
    in_page = state.pages == (new // page)[:, None]  # [G, P]
    paged = in_page.any(axis=1)  # [G]: the cell lies in a page the group reads in place
    slot = np.where(paged, in_page.argmax(axis=1) * page + new % page, n_pages * page + state.counts)
    tail, mask = b.tail, b.mask
    if mask is None:
        mask = mx.ones((new.size, 1, 1, n_pages * page + (0 if tail is None else tail.shape[1])), dtype=mx.bool_)
    if not paged.all():
        width = 0 if tail is None else tail.shape[1]
        if state.counts[~paged].max() == width:  # one more tail slot, masked until a group takes it
            column = mx.array(new.astype(np.int32))[:, None]  # [G, 1]: any valid cell pads
            tail = column if tail is None else mx.concatenate([tail, column], axis=1)
            mask = mx.concatenate([mask, mx.zeros((new.size, 1, 1, 1), dtype=mx.bool_)], axis=3)
        at = np.where(paged, 0, state.counts)  # a group whose cell is paged writes its own tail slot 0 again
        kept = mx.take_along_axis(tail, mx.array(at.astype(np.int32))[:, None], axis=1)
        tail = mx.put_along_axis(tail, mx.array(at.astype(np.int32))[:, None],
                                 mx.where(mx.array(paged)[:, None], kept, mx.array(new.astype(np.int32))[:, None]),
                                 axis=1)
        state.counts = state.counts + ~paged
    mask = mx.put_along_axis(mask, mx.array(slot.astype(np.int32)).reshape(-1, 1, 1, 1), mx.array(True), axis=3)
    return AttendBatch(b.tokens, b.cells, mask, page, tail)


def _gathered(cells: mx.array, counts: np.ndarray, new: np.ndarray) -> tuple[mx.array, mx.array | None]:
    """A gathered batch's cells `[G, K]` with `new` [G] at each group's slot `counts` (counts moved on
    in place), and its mask: each group's first `counts` slots (None when all of them are)."""
    listed = counts.tolist()  # a few groups: Python's max and all, not numpy's (cold on a step's path)
    column = mx.array([[c] for c in new.tolist()], dtype=mx.int32)  # [G, 1], made as it is: one op
    if listed.count(cells.shape[1]) == len(listed):  # every group full (sequences in lockstep): one more column
        counts += 1
        return mx.concatenate([cells, column], axis=1), None
    if max(listed) == cells.shape[1]:
        cells = mx.concatenate([cells, column], axis=1)  # one more slot: padding is any valid cell
    at = mx.array([[n] for n in listed], dtype=mx.int32)  # [G, 1]: each group's next slot
    cells = mx.put_along_axis(cells, at, column, axis=1)
    counts += 1
    width = cells.shape[1]
    if all(n + 1 == width for n in listed):
        return cells, None
    mask = mx.arange(width, dtype=mx.int32)[None, :] <= at  # [G, K]: slots up to the new one (the same `at`)
    return cells, mask.reshape(-1, 1, 1, width)
