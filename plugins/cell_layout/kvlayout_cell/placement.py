"""The cell layout's default placement: each sequence in pages of its own (`own_pages`, the rule of the
`kvlayout_choose_cells` hookspec), and the small id helpers placement and the stepper share.

Neutral like the table: numpy only, stateless, everything it needs in its arguments. The plugin
(`kvlayout_cell.plugin`) registers `kvlayout_choose_cells` (the rule, `choose_cells`, behind the hook's
name); the stepper calls the rule directly when that is the only placement registered
(`kvlayout.registry.sole_implementation`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvlayout import hookimpl
from kvlayout_cell.groups import PLACEMENT_PAGE

FEW_IDS = 256  # up to this many ids, `distinct_sorted` finds them in Python


def choose_cells(free: np.ndarray, seq_ids: np.ndarray, prev_cells: np.ndarray, window: int) -> np.ndarray:
    """Each sequence in pages of its own, so paged attention reads them in place."""
    return own_pages(free, seq_ids, prev_cells, page_for(window), run_on=window == 0)


@hookimpl(trylast=True)
def kvlayout_choose_cells(free: np.ndarray, seq_ids: np.ndarray, prev_cells: np.ndarray, window: int) -> np.ndarray:
    """The default placement (`choose_cells`), last: any other policy's answer wins. `kvlayout_cell.plugin`
    registers it; a function of its own, so `choose_cells` stays a plain one to import."""
    return choose_cells(free, seq_ids, prev_cells, window)


def continue_each(prev_cells: list[int], is_free: Callable[[int], bool], page: int) -> list[int] | None:
    """`own_pages`'s answer for a decode step that its first pass places whole, in Python over a few
    tokens, asking `is_free(cell)` instead of searching the free list; None for any other step.

    Every token's sequence continues in the cell after its previous one: the previous cells are
    distinct (so is every token's sequence: a decode step) and occupied (a cell a caller says is
    free starts no run), and each next cell is free and in the same page of `page` cells."""
    if len(set(prev_cells)) != len(prev_cells):
        return None
    cells = []
    for prev in prev_cells:
        cell = prev + 1
        if prev < 0 or not cell % page or is_free(prev) or not is_free(cell):
            return None
        cells.append(cell)
    return cells


def page_for(window: int, page: int = PLACEMENT_PAGE) -> int:
    """The page a table's sequences take cells in: `page` for the flat layers', and for a window's
    the least power of two covering the window, at most `page` (a sequence then holds its last
    window in two pages or three, not two of `page` whatever its window)."""
    return page if window <= 0 else min(page, 1 << (window - 1).bit_length())


def distinct_sorted(values: np.ndarray) -> np.ndarray:
    """What np.unique gives for int64 `values`: the distinct ones, ascending. Up to FEW_IDS of them
    (a step's ids or cells) through Python's set: on a step's path the first call of numpy's sort
    costs tens of microseconds of cold code, where a microbenchmark's hot loop says ~2."""
    if values.size <= FEW_IDS:
        return np.array(sorted(set(values.tolist())), dtype=np.int64)
    ordered = np.sort(values)  # np.unique's answer, in fewer steps when every value is distinct (decode)
    keep = ordered[1:] != ordered[:-1]
    return ordered if keep.all() else ordered[np.r_[True, keep]]


def lowest_free(free: np.ndarray, count: int) -> np.ndarray:
    """The lowest free cells, so a freed cell refills before the table grows: the default placement
    before pages of their own (`kvlayout_cell.plugin.LowestFree` answers it)."""
    return free[:count]


def own_pages(free: np.ndarray, seq_ids: np.ndarray, prev_cells: np.ndarray, page: int = PLACEMENT_PAGE,
              run_on: bool = True) -> np.ndarray:
    """A distinct cell of `free` (ascending) for each token, in token order: each sequence
    continues after its previous cell within that cell's page, then fills fresh pages of `page`
    cells (`run_on`: the page after its last one's first, when fresh), then (none left) takes the
    lowest free cells (the three passes of the hookspec).

    `seq_ids`, `prev_cells` int `[T]` as the hook hears them (every token of a sequence carries
    its cell from before the step). O(T log + the free cells scanned for fresh pages).
    """
    free = np.asarray(free, dtype=np.int64)
    prev_cells = np.asarray(prev_cells, dtype=np.int64)
    if prev_cells.size == 1:  # one sequence decoding alone, the commonest step: pass 1 in a few ops
        after = int(prev_cells[0]) + 1
        at = int(free.searchsorted(after))
        if after > 0 and after % page and at < free.size and free[at] == after:
            return np.array([after], dtype=np.int64)
    elif _decoding_on(free, prev_cells, page):  # every sequence one token: pass 1 in a few ops
        return prev_cells + 1
    cells = np.full(prev_cells.size, -1, dtype=np.int64)  # [T]; -1: no cell yet
    taken = np.zeros(free.size, dtype=bool)  # by index into free: given to a token of this step
    order, starts, counts = _by_sequence(np.asarray(seq_ids, dtype=np.int64))
    prev = prev_cells[order[starts]]  # [N]: each sequence's cell from before the step
    last = _continue(free, taken, cells, order, starts, counts, prev, page)
    _fill_fresh_pages(_FreshPages(free, taken, page), cells, order, starts, counts, last if run_on else None)
    _lowest_left(free, taken, cells)
    return cells


def _decoding_on(free: np.ndarray, prev_cells: np.ndarray, page: int) -> bool:
    """Whether pass 1 alone places the step by giving each token the cell after its previous one, as
    `own_pages` would, settled without sorting the step by sequence: the previous cells are distinct
    (so is every token's sequence: a decode step, no fork beside its source) and occupied (a cell
    a caller says is free starts no run), and each next cell is free and in the same page."""
    after = prev_cells + 1
    if (prev_cells < 0).any() or not (after % page).all() or not _in(free, after).all():
        return False
    if _in(free, prev_cells).any():
        return False
    return distinct_sorted(prev_cells).size == prev_cells.size


def _by_sequence(seq_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order [T], starts [N], counts [N]): tokens by sequence, sequences in the order of their first
    token and tokens in step order within one; where each sequence's tokens start in `order`, how many."""
    _, first_at, inverse = np.unique(seq_ids, return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first_at))[inverse.reshape(-1)]  # [T]: its sequence's rank by first token
    counts = np.bincount(rank, minlength=first_at.size)
    return np.argsort(rank, kind="stable"), np.cumsum(counts) - counts, counts


def _continue(free, taken, cells, order, starts, counts, prev, page) -> np.ndarray:
    """Pass 1 (nothing taken yet): each sequence's first tokens take the free cells right after its
    previous cell, within that cell's page; of sequences sharing a previous cell (a fork and its
    source), only the first. Fills `cells` and `taken`; each sequence's last cell so far `[N]`
    (-1: none).

    A previous cell is occupied (its sequence's newest), so the runs after distinct ones never
    meet: each ends before the next occupied cell. One a caller says is free starts no run.
    """
    lead = np.zeros(prev.size, dtype=bool)
    lead[np.unique(prev, return_index=True)[1]] = True  # the first sequence with each previous cell
    lead &= (prev >= 0) & ~_in(free, prev)
    room = np.where(lead, np.minimum(counts, page - 1 - prev % page), 0)  # [N]: its cells left in the page
    seq = np.repeat(np.arange(prev.size), room)  # [R]: one entry per cell a sequence might continue into
    j = np.arange(seq.size) - np.repeat(np.cumsum(room) - room, room)  # [R]: its offset after prev
    want = prev[seq] + 1 + j  # [R]: the cell
    run = room.copy()  # [N]: a sequence continues up to its first cell that is not free
    gap = ~_in(free, want)
    np.minimum.at(run, seq[gap], j[gap])
    keep = j < run[seq]
    cells[order[starts[seq[keep]] + j[keep]]] = want[keep]
    taken[np.searchsorted(free, want[keep])] = True
    return np.where(run > 0, prev + run, prev)


def _in(free: np.ndarray, cells: np.ndarray) -> np.ndarray:
    """bool, like `cells`: which are in `free` (ascending)."""
    if not free.size:
        return np.zeros(cells.shape, dtype=bool)
    return free[np.minimum(np.searchsorted(free, cells), free.size - 1)] == cells


class _FreshPages:
    """Aligned pages of `page` cells all free and none taken, found in `free` (ascending) lowest
    first: scanned in chunks that double, so a step looks only as far as the pages it takes."""

    def __init__(self, free: np.ndarray, taken: np.ndarray, page: int):
        self.free, self.taken, self.page = free, taken, page
        self._found: list[int] = []  # indices into free of pages found, not yet handed out, descending
        self._scanned = 0  # free[:_scanned] has been searched for page starts
        self._chunk = 16 * page

    def take(self, after: int) -> int | None:
        """The index in free of a fresh page's first cell: the page after cell `after`'s when it is
        fresh (a sequence's pages then run on), else the lowest; None when there is none."""
        if after >= 0:
            x = self._fresh_at((after // self.page + 1) * self.page)
            if x is not None:
                return x
        while True:
            while not self._found:
                if not self._scan():
                    return None
            x = self._found.pop()
            if not self.taken[x : x + self.page].any():
                return x

    def _fresh_at(self, first: int) -> int | None:
        """The index of cell `first` in free when the page it begins is all free and none of it taken."""
        free, page = self.free, self.page
        x = int(np.searchsorted(free, first))
        if x + page > free.size or free[x] != first or free[x + page - 1] != first + page - 1:
            return None  # free ascends with no repeats: the page's cells are all there iff its ends are
        return None if self.taken[x : x + page].any() else x

    def _scan(self) -> bool:
        """Find the page starts in the next chunk of free; False when it is all searched."""
        free, page, lo = self.free, self.page, self._scanned
        end = free.size - page + 1  # a page must start before this index to fit
        if lo >= end:
            return False
        hi = min(lo + self._chunk, end)
        head, tail = free[lo:hi], free[lo + page - 1 : hi + page - 1]
        starts = np.flatnonzero((head % page == 0) & (tail - head == page - 1)) + lo
        self._found = starts[::-1].tolist()
        self._scanned, self._chunk = hi, 2 * self._chunk
        return True


def _fill_fresh_pages(pages: _FreshPages, cells, order, starts, counts, last) -> None:
    """Pass 2: sequence by sequence, the tokens pass 1 left fill fresh pages, each from its first cell."""
    free, taken, page = pages.free, pages.taken, pages.page
    for k in np.flatnonzero(cells[order[starts + counts - 1]] < 0):  # a sequence whose last token has no cell
        tokens = order[starts[k] : starts[k] + counts[k]]
        tokens = tokens[cells[tokens] < 0]
        after = -1 if last is None else int(last[k])  # -1: the lowest fresh page
        for lo in range(0, tokens.size, page):
            x = pages.take(after)
            if x is None:
                return  # no fresh page left, for this sequence or any later one: pass 3
            n = min(page, tokens.size - lo)
            cells[tokens[lo : lo + n]] = free[x : x + n]
            taken[x : x + n] = True
            after = -1 if last is None else int(free[x + n - 1])


def _lowest_left(free, taken, cells) -> None:
    """Pass 3: tokens still without a cell take the lowest free cells not taken, in token order."""
    need = np.flatnonzero(cells < 0)
    if need.size:
        placed = cells.size - need.size  # that many of free are taken: the lowest left are in what follows
        cells[need] = free[np.flatnonzero(~taken[: need.size + placed])[: need.size]]
