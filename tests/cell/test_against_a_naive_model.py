"""Random verbs and steps, checked against a naive model of the design's rules.

The model keeps a dict per cell and loops over everything; it shares no code
with the layout. Each step's cells (lowest free first) and the mask of every
window must agree with it, and so must every sequence's length and next
position after every verb.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.cell.support import stepper

WINDOWS = (0, 3, 0, 1)


class NaiveCells:
    def __init__(self, capacity, max_seqs):
        self.capacity, self.max_seqs = capacity, max_seqs
        self.cells = [None] * capacity  # None or (pos, set of owners)
        self.live = set()

    def owned(self, s):
        return [(c, x[0]) for c, x in enumerate(self.cells) if x is not None and s in x[1]]

    def seq_len(self, s):
        return len(self.owned(s))

    def next_pos(self, s):
        return max((p for _, p in self.owned(s)), default=-1) + 1

    def used_end(self):
        return max((c + 1 for c, x in enumerate(self.cells) if x is not None), default=0)

    def seq_new(self):
        s = min(set(range(self.max_seqs)) - self.live, default=None)
        if s is not None:
            self.live.add(s)
        return s

    def seq_clone(self, src, upto):
        dst = self.seq_new()
        if dst is not None:
            for c, p in self.owned(src):
                if upto is None or p < upto:
                    self.cells[c][1].add(dst)
        return dst

    def seq_rm(self, s, p0, p1):
        for c, p in self.owned(s):
            if p >= p0 and (p1 is None or p < p1):
                self.cells[c][1].discard(s)
                if not self.cells[c][1]:
                    self.cells[c] = None
        if not self.owned(s):
            self.live.discard(s)

    def place(self, tokens):
        free = [c for c, x in enumerate(self.cells) if x is None]
        cells = free[: len(tokens)]
        for c, (s, p) in zip(cells, tokens):
            self.cells[c] = (p, {s})
        return cells

    def mask(self, tokens, window):
        rows = []
        for s, p in tokens:
            row = ""
            for x in self.cells[: self.used_end()]:
                ok = x is not None and s in x[1] and x[0] <= p and (not window or x[0] >= p - window + 1)
                row += "1" if ok else "."
            rows.append(row)
        return rows


def rows(mask):
    return ["".join("1" if x else "." for x in r) for r in mask]


@pytest.mark.parametrize("seed", range(6))
def test_random_verbs_and_steps_agree_with_the_naive_model(seed):
    rng = np.random.default_rng(seed)
    max_seqs = [5, 70][seed % 2]  # one word of owner bits, and two
    t, model = stepper(capacity=48, windows=WINDOWS, max_seqs=max_seqs), NaiveCells(48, max_seqs)
    for _ in range(80):
        live = sorted(model.live)
        op = rng.integers(5)
        if op == 0 or not live:
            assert t.seq_new() == model.seq_new()
        elif op == 1:
            src = int(rng.choice(live))
            upto = None if rng.random() < 0.5 else int(rng.integers(0, model.next_pos(src) + 2))
            assert t.seq_clone(src, upto) == model.seq_clone(src, upto)
        elif op == 2:
            s = int(rng.choice(live))
            p0 = int(rng.integers(0, model.next_pos(s) + 1))
            p1 = None if rng.random() < 0.3 else p0 + int(rng.integers(0, 4))
            t.seq_rm(s, p0, p1)
            model.seq_rm(s, p0, p1)
        else:
            chosen = [int(s) for s in rng.choice(live, size=min(len(live), 3), replace=False)]
            tokens = []
            for s in chosen:  # a few rising positions per sequence, gaps allowed, tokens interleaved
                p = model.next_pos(s) + int(rng.integers(0, 2))
                tokens += [(s, p + i) for i in range(int(rng.integers(1, 4)))]
            tokens = [tokens[i] for i in rng.permutation(len(tokens))]
            tokens.sort(key=lambda sp: sp[1])  # keep each sequence's positions rising in token order
            if not t.declare_step([s for s, _ in tokens]):
                assert len(tokens) > sum(x is None for x in model.cells)
                continue
            cells = model.place(tokens)
            for layer, window in enumerate(WINDOWS):
                st = t.place_step(layer, [p for _, p in tokens])
                assert st.cells.tolist() == cells
                assert rows(st.mask) == model.mask(tokens, window)
        assert t.used_end == model.used_end()
        assert t.free_cells == sum(x is None for x in model.cells)
        for s in range(max_seqs):
            assert (t.seq_len(s), t.next_pos(s)) == (model.seq_len(s), model.next_pos(s)), s
