"""Each sequence's cells by position, kept beside the cell table so nothing scans the table for them.

The cell table answers "who owns cell c" in O(1) (owner bits per cell); the
grouped attention plan, `seq_rm` and `seq_clone` ask the other way round,
"which cells does s own, by position", which from the bits alone is a scan
of every cell up to `used_end` per sequence: O(step sequences x used_end)
per step. This index keeps the answer: per id, its positions (ascending)
and the cell of each, in two growable int64 buffers.

A step only appends: a sequence's new tokens are newer than any it holds
(`CellTable.check_tokens`), so they go after its last entry, in the step's
order. Undoing that step truncates; `seq_rm` cuts a range out; `seq_clone`
copies a prefix. Neutral: numpy only. Its bytes grow with what is owned:
16 B per (cell, owner) pair, a fork holding its own copy of the prefix it shares.
"""

from __future__ import annotations

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)


class SeqIndex:
    def __init__(self, max_seqs: int):
        self._max_seqs = max_seqs
        self.clear()

    def clear(self) -> None:
        """Every id owns nothing."""
        self._pos = [_EMPTY] * self._max_seqs  # per id: a buffer, the first _len[s] entries in use
        self._cells = [_EMPTY] * self._max_seqs
        self._len = [0] * self._max_seqs

    def get(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        """(cells, positions) of id `s`, by position: views, valid until the index next changes."""
        n = self._len[s]
        return self._cells[s][:n], self._pos[s][:n]

    def size(self, s: int) -> int:
        return self._len[s]

    def append(self, seq_ids: np.ndarray, positions: np.ndarray, cells: np.ndarray) -> None:
        """Token i (position positions[i]) of seq_ids[i] is in cells[i]; each id's positions rise
        within the step and are newer than any it holds."""
        if seq_ids.size == 1:
            self._extend(int(seq_ids[0]), positions, cells)
            return
        ids = seq_ids.tolist()
        if len(set(ids)) == len(ids):  # one token a sequence (a decode step): no sorting (numpy's costs a step ~0.1 ms)
            for s, p, c in zip(ids, positions.tolist(), cells.tolist()):
                self.append_one(s, p, c)
            return
        order = np.argsort(seq_ids, kind="stable")  # by id, step order (so position order) within one
        ids = seq_ids[order]
        bounds = [0, *(np.flatnonzero(ids[1:] != ids[:-1]) + 1).tolist(), ids.size]
        for lo, hi in zip(bounds, bounds[1:]):
            part = order[lo:hi]
            self._extend(int(ids[lo]), positions[part], cells[part])

    def append_one(self, s: int, position: int, cell: int) -> None:
        """`append` of one token (a lone decode), without the arrays."""
        n = self._len[s]
        if n == self._pos[s].size:
            self._grow(s, n + 1)
        self._pos[s][n] = position
        self._cells[s][n] = cell
        self._len[s] = n + 1

    def truncate(self, seq_ids: np.ndarray) -> None:
        """Undo the `append` of a step of these tokens: each id loses as many entries from its end."""
        ids, counts = np.unique(seq_ids, return_counts=True)
        for s, k in zip(ids.tolist(), counts.tolist()):
            self._len[s] -= k

    def copy_between(self, src: int, dst: int, since: int, upto: int | None) -> None:
        """`dst` (owning nothing) gets `src`'s entries with since <= position < upto (upto None: to the end)."""
        cells, pos = self.get(src)
        lo = int(np.searchsorted(pos, since, side="left")) if since else 0
        n = pos.size if upto is None else int(np.searchsorted(pos, upto, side="left"))
        lo = min(lo, n)
        self._set(dst, pos[lo:n].copy(), cells[lo:n].copy())

    def cut(self, s: int, p0: int, p1: int | None) -> np.ndarray:
        """Drop `s`'s entries with p0 <= position < p1 (p1 None: to the end); the cells they named."""
        cells, pos = self.get(s)
        lo = int(np.searchsorted(pos, p0, side="left"))
        hi = pos.size if p1 is None else int(np.searchsorted(pos, p1, side="left"))
        gone = cells[lo:hi].copy()
        if hi == pos.size:  # the tail (a finished sample, the rest of a sequence): shorten in place
            self._len[s] = lo
        else:
            self._set(s, np.concatenate([pos[:lo], pos[hi:]]), np.concatenate([cells[:lo], cells[hi:]]))
        return gone

    def set_all(self, s: int, positions: np.ndarray, cells: np.ndarray) -> None:
        """`s` owns exactly these (any order; positions distinct): a restored table."""
        order = np.argsort(positions, kind="stable")
        self._set(s, np.asarray(positions, dtype=np.int64)[order], np.asarray(cells, dtype=np.int64)[order])

    def _set(self, s: int, positions: np.ndarray, cells: np.ndarray) -> None:
        self._pos[s], self._cells[s], self._len[s] = positions, cells, positions.size

    def _grow(self, s: int, need: int) -> None:
        """Room for `need` entries, by doubling: appending a token is O(1) amortized."""
        n, size = self._len[s], max(2 * self._pos[s].size, need, 16)
        for buffers in (self._pos, self._cells):
            grown = np.empty(size, dtype=np.int64)
            grown[:n] = buffers[s][:n]
            buffers[s] = grown

    def _extend(self, s: int, positions: np.ndarray, cells: np.ndarray) -> None:
        n, k = self._len[s], positions.size
        if n + k > self._pos[s].size:
            self._grow(s, n + k)
        self._pos[s][n : n + k] = positions
        self._cells[s][n : n + k] = cells
        self._len[s] = n + k
