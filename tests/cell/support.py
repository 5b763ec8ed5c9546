"""Builders shared by the cell-layout tests."""

from __future__ import annotations

import numpy as np

from kvlayout.faces import BatchControl, face_of
from kvlayout.registry import make_plugin_manager
from kvlayout_cell.plugin import OwnPages
from kvlayout_cell.stepper import Stepper
from kvlayout_cell.table import CellTable


def stepper(capacity=16, windows=(0, 0), max_seqs=64, pm=None) -> Stepper:
    """A neutral cell stepper (two flat layers by default) on a fresh plugin manager."""
    return Stepper(CellTable(capacity, max_seqs), windows, make_plugin_manager() if pm is None else pm)


def placement_manager(page: int | None = None):
    """A fresh plugin manager placing by the default rule, over pages of `page` cells when given."""
    pm = make_plugin_manager()
    if page is not None:
        pm.register(OwnPages(page))
    return pm


def rows(mask) -> list[str]:
    """A mask as strings, one per query: '1' attends, '.' does not."""
    return ["".join("1" if x else "." for x in row) for row in np.asarray(mask)]


def fill(table, seq: int, positions, layers=None):
    """Declare a step of `seq` at `positions` and serve every layer; the first layer's step."""
    positions = list(positions)
    assert table.declare_step([seq] * len(positions))
    steps = [table.place_step(layer, positions) for layer in range(table.n_layers if layers is None else layers)]
    return steps[0]


def step(table, tokens):
    """Declare and place a mixed step `[(seq, pos), ...]` on every layer; the first layer's step."""
    seqs, positions = [s for s, _ in tokens], [p for _, p in tokens]
    assert table.declare_step(seqs)
    steps = [table.place_step(layer, positions) for layer in range(table.n_layers)]
    return steps[0]


class OneTable:
    """What a bare stepper's BatchControl face takes beside it: one table for every layer, nothing
    retired (a cache's LayerGroups answers these for its tables)."""

    def __init__(self, table):
        self.table = table

    def seq_floor(self, seq_id):
        self.table.live_id("seq_id", seq_id)
        return 0

    def cells_by_window(self):
        return {0: self.table.capacity - self.table.free_cells}

    def seq_pin(self, seq_id, pinned=True):
        self.table.live_id("seq_id", seq_id)


def bare_control(st: Stepper):
    """The BatchControl face over a bare stepper, as a cache of one layer group hands out over its own."""
    return face_of(BatchControl, st, st.table, OneTable(st.table))


def control(table):
    """The BatchControl face of a cell cache, or of a bare stepper (the one a cache hands out over its own)."""
    return table.as_batch_control() if hasattr(table, "as_batch_control") else bare_control(table)


def snapshot(table) -> tuple:
    """Everything a caller can observe about the table's bookkeeping, through its BatchControl face."""
    bc = control(table)
    per_id = tuple((bc.seq_len(s), bc.next_pos(s)) for s in range(bc.max_seqs))
    return bc.free_cells, bc.used_end, per_id


def naive_placement(free, tokens, page: int, run_on: bool = True) -> list[int]:
    """The default placement's rule as the `kvlayout_choose_cells` hookspec states it, the slow and
    obvious way (sets and loops, no code shared with the plugin).

    `run_on`: a flat layers' table (window 0), where a sequence's fresh page is the one right after
    its last cell's when that one is fresh; a window's table (False) always takes the lowest.

    `free`: the free cells; `tokens`: `[(seq, prev_cell), ...]` in token order, prev_cell the cell
    of the sequence's newest position before the step (-1: none). A cell per token.
    """
    free, taken, cells = set(free), set(), [None] * len(tokens)
    order = list(dict.fromkeys(s for s, _ in tokens))  # sequences by first token
    mine = {s: [i for i, (t, _) in enumerate(tokens) if t == s] for s in order}
    last = {s: tokens[mine[s][0]][1] for s in order}
    # 1. continue after the previous cell, within its page; a shared previous cell: the first sequence
    continued_from = set()
    for s in order:
        prev = last[s]
        if prev < 0 or prev in continued_from:
            continue
        continued_from.add(prev)
        for i in mine[s]:
            cell = last[s] + 1
            if cell // page != prev // page or cell not in free or cell in taken:
                break
            cells[i], last[s] = cell, cell
            taken.add(cell)

    # 2. fresh pages, from their first cell: the one after the last cell's page, else the lowest
    def fresh(p):
        return all(c in free and c not in taken for c in range(p * page, (p + 1) * page))

    for s in order:
        left = [i for i in mine[s] if cells[i] is None]
        while left:
            if run_on and last[s] >= 0 and fresh(last[s] // page + 1):
                p = last[s] // page + 1
            else:
                p = next((q for q in sorted({c // page for c in free}) if fresh(q)), None)
            if p is None:
                break
            for j, i in enumerate(left[:page]):
                cells[i] = last[s] = p * page + j
                taken.add(cells[i])
            left = left[page:]
    # 3. the lowest free cells left, in token order
    rest = sorted(free - taken)
    for i in range(len(tokens)):
        if cells[i] is None:
            cells[i] = rest.pop(0)
    return cells
