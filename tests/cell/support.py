"""Builders shared by the cell-layout tests."""

from __future__ import annotations

import numpy as np

from kvlayout.registry import make_plugin_manager
from kvlayout_cell.stepper import Stepper
from kvlayout_cell.table import CellTable


def stepper(capacity=16, windows=(0, 0), max_seqs=64, pm=None) -> Stepper:
    """A neutral cell stepper (two flat layers by default) on a fresh plugin manager."""
    return Stepper(CellTable(capacity, max_seqs), windows, make_plugin_manager() if pm is None else pm)


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


def snapshot(table) -> tuple:
    """Everything a caller can observe about the table's bookkeeping."""
    per_id = tuple((table.seq_len(s), table.next_pos(s)) for s in range(table.max_seqs))
    return table.free_cells, table.used_end, per_id
