"""The cell table, model-checked: random verbs and steps against a deliberately naive model.

The model is a dict from cell to (position, set of owners) and loops over
everything, straight from docs/design.md: a step's cells follow the default
placement's rule (`support.naive_placement`, over pages of 4, 8 or the
plugin's own PLACEMENT_PAGE cells, so a small table has pages too), and
query i attends cell j iff j is occupied, shares i's sequence, is no newer
than i and, on a ring layer of window w, no older than `pos_i - w + 1`. It
shares no code with the layout.

Hypothesis drives seq_new, seq_clone (with and without upto), seq_rm over
random ranges, clear, declare_step, and place_step over random layers of a
random mix of flat and ring layers (some windows equal), plus calls that must
be refused: ids out of range or not live, a miscounted step, a position not
newer than its sequence holds, a layer served twice, a step never declared,
and every verb but clear while a placed step is half served (a forward in
progress: clear aborts it and clears).
Each refusal must leave every observable number as it was, and the standing
declaration must still serve. After every rule the free count, used_end and
each id's seq_len, next_pos and newest cell equal the model's; every placed
step's cells and full mask are compared when it is served.

Example counts come from the hypothesis profile (tests/conftest.py).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlayout.errors import SequenceError, StepError
from kvlayout_cell.groups import PLACEMENT_PAGE
from kvlayout_cell.stepper import Stepper
from kvlayout_cell.table import CellTable
from tests.cell.support import bare_control, naive_placement, placement_manager


@functools.cache
def plugin_manager(page):
    """One fresh manager per page size for every example: it places by the default rule."""
    return placement_manager(None if page == PLACEMENT_PAGE else page)


class NaiveCells:
    """The design's rules, written the slow and obvious way."""

    def __init__(self, capacity: int, max_seqs: int, page: int):
        self.capacity, self.max_seqs, self.page = capacity, max_seqs, page
        self.clear()

    def clear(self):
        self.cells: dict[int, tuple[int, set[int]]] = {}  # occupied cell -> (position, owners)
        self.live: set[int] = set()
        self.declared: list[int] | None = None  # the standing declaration's ids
        self.placed: dict | None = None  # the open step: tokens, cells, read_len, served layers, masks

    def end_step(self):
        """Any verb that changes the table ends the declaration and the placed step."""
        self.declared = self.placed = None

    def owned(self, s):
        return [(c, p) for c, (p, owners) in sorted(self.cells.items()) if s in owners]

    def seq_len(self, s):
        return len(self.owned(s))

    def next_pos(self, s):
        return max((p for _, p in self.owned(s)), default=-1) + 1

    def used_end(self):
        return max(self.cells, default=-1) + 1

    def free(self):
        return [c for c in range(self.capacity) if c not in self.cells]

    def seq_new(self):
        free_ids = [s for s in range(self.max_seqs) if s not in self.live]
        if not free_ids:
            return None
        self.live.add(free_ids[0])
        self.end_step()
        return free_ids[0]

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
                    del self.cells[c]
        if not self.owned(s):
            self.live.discard(s)
        self.end_step()

    def newest_cell(self, s):
        return max(self.owned(s), key=lambda cell_pos: cell_pos[1], default=(-1, -1))[0]

    def place(self, tokens):
        cells = naive_placement(self.free(), [(s, self.newest_cell(s)) for s, _ in tokens], self.page)
        for c, (s, p) in zip(cells, tokens):
            self.cells[c] = (p, {s})
        return cells

    def mask(self, tokens, window, read_len):
        """One string per query: '1' where it attends cell j of [0, read_len)."""
        rows = []
        for s, p in tokens:
            row = ""
            for j in range(read_len):
                attends = False
                if j in self.cells:
                    pos_j, owners = self.cells[j]
                    attends = s in owners and pos_j <= p and (window == 0 or pos_j >= p - window + 1)
                row += "1" if attends else "."
            rows.append(row)
        return rows


def rows(mask) -> list[str]:
    return ["".join("1" if x else "." for x in r) for r in np.asarray(mask)]


WINDOWS = st.lists(st.sampled_from([0, 0, 1, 2, 3, 5]), min_size=1, max_size=4)
MAX_SEQS = st.sampled_from([3, 5, 66])  # 66: owner bits span two 64-bit words
PAGES = st.sampled_from([4, 8, PLACEMENT_PAGE])  # the placement's page: the plugin's own fits no table here


class CellTableMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(4, 32), max_seqs=MAX_SEQS, windows=WINDOWS, page=PAGES)
    def setup(self, capacity, max_seqs, windows, page):
        self.t = Stepper(CellTable(capacity, max_seqs), windows, plugin_manager(page))
        self.bc = bare_control(self.t)  # the face a cache hands out over its stepper
        self.m = NaiveCells(capacity, max_seqs, page)
        self.windows = windows

    # -- helpers -------------------------------------------------------------

    def live(self):
        return sorted(self.m.live)

    def half_served(self) -> bool:
        """A step is placed and some layer has not served it: every verb but clear is refused."""
        return self.m.placed is not None and len(self.m.placed["served"]) < len(self.windows)

    def refused_mid_forward(self, call) -> bool:
        """When a step is half served, `call()` is refused (StepError), changing nothing; True then."""
        if not self.half_served():
            return False
        self.refused(StepError, call, match="during a forward")
        return True

    def observed(self):
        t = self.t
        per_id = [(t.table.seq_len(s), t.table.next_pos(s)) for s in range(t.table.max_seqs)]
        return t.table.free_cells, t.table.used_end, tuple(t.table.free_list().tolist()), per_id

    def refused(self, error, call, match=None):
        """`call()` raises `error` and changes nothing, the model's standing step included."""
        before = self.observed()
        standing = (self.m.declared, self.m.placed and set(self.m.placed["served"]))
        with pytest.raises(error, match=match):
            call()
        assert self.observed() == before
        assert (self.m.declared, self.m.placed and set(self.m.placed["served"])) == standing

    def positions_for(self, data, ids):
        """Rising positions per sequence, each newer than what it holds; small gaps allowed."""
        last: dict[int, int] = {}
        out = []
        for s in ids:
            floor = max(self.m.next_pos(s), last.get(s, -1) + 1)
            p = floor + data.draw(st.sampled_from([0, 0, 0, 1, 2]), label="gap")
            last[s] = p
            out.append(p)
        return out

    def check_step(self, step, layer):
        placed = self.m.placed
        window = self.windows[layer]
        assert step.cells.tolist() == placed["cells"]
        assert step.length == len(placed["tokens"]) and step.read_len == placed["read_len"]
        assert step.mask.shape == (step.length, step.read_len)
        assert rows(step.mask) == self.m.mask(placed["tokens"], window, placed["read_len"])
        shared = placed["masks"].setdefault(window, step.mask)
        assert shared is step.mask  # layers with the same window share one mask
        placed["served"].add(layer)

    # -- verbs ---------------------------------------------------------------

    @rule()
    def seq_new(self):
        if not self.refused_mid_forward(self.t.seq_new):
            assert self.t.seq_new() == self.m.seq_new()

    @precondition(lambda self: self.m.live)
    @rule(data=st.data())
    def seq_clone(self, data):
        src = data.draw(st.sampled_from(self.live()), label="src")
        upto = data.draw(st.none() | st.integers(0, self.m.next_pos(src) + 1), label="upto")
        if not self.refused_mid_forward(lambda: self.t.seq_clone(src, upto)):
            assert self.t.seq_clone(src, upto) == self.m.seq_clone(src, upto)

    @precondition(lambda self: self.m.live)
    @rule(data=st.data())
    def seq_rm(self, data):
        s = data.draw(st.sampled_from(self.live()), label="seq_id")
        top = self.m.next_pos(s) + 1
        p0 = data.draw(st.integers(0, top), label="p0")
        p1 = data.draw(st.none() | st.integers(p0, top + 1), label="p1")
        if not self.refused_mid_forward(lambda: self.t.seq_rm(s, p0, p1)):
            self.t.seq_rm(s, p0, p1)
            self.m.seq_rm(s, p0, p1)

    @rule()
    def clear(self):
        self.t.clear()  # a half-served step is aborted first: the model forgets it with the rest
        self.m.clear()
        assert self.t.unserved_layers() == []

    # -- steps ---------------------------------------------------------------

    @precondition(lambda self: self.m.live)
    @rule(data=st.data())
    def declare(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, max_size=6), label="seq_ids")
        if self.refused_mid_forward(lambda: self.t.declare_step(ids)):
            return
        fits = len(ids) <= len(self.m.free())
        assert self.t.declare_step(ids) is fits  # False only for lack of free cells
        if fits:
            self.m.declared, self.m.placed = ids, None

    @precondition(lambda self: self.m.declared is not None)
    @rule(data=st.data())
    def place(self, data):
        """The first layer served places the step: the default placement's cells, one per token."""
        ids = self.m.declared
        positions = self.positions_for(data, ids)
        layer = data.draw(st.integers(0, len(self.windows) - 1), label="layer")
        step = self.t.place_step(layer, positions)
        tokens = list(zip(ids, positions))
        cells = self.m.place(tokens)
        self.m.declared = None
        self.m.placed = dict(tokens=tokens, cells=cells, read_len=self.m.used_end(), served=set(), masks={})
        self.check_step(step, layer)

    @precondition(lambda self: self.m.live)
    @rule(data=st.data())
    def forward(self, data):
        """declare + place + serve some layers in a random order, in one rule (the common case)."""
        self.declare(data)
        if self.m.declared is None:
            return  # refused for lack of cells
        for mischief in data.draw(st.lists(st.sampled_from(list(self.BEFORE_PLACING)), max_size=2), label="mischief"):
            self.BEFORE_PLACING[mischief](self, data)  # refused; the declaration stands for the place below
        self.place(data)
        for _ in range(data.draw(st.integers(0, len(self.windows) - 1), label="more layers")):
            if data.draw(st.booleans(), label="serve one twice"):
                self.refuse_a_layer_served_twice(data)
            self.serve(data)

    @precondition(lambda self: self.m.live)
    @rule(data=st.data())
    def full_forward(self, data):
        """declare, then every layer once."""
        self.declare(data)
        if self.m.declared is not None:
            self.place(data)
            while len(self.m.placed["served"]) < len(self.windows):
                self.serve(data)

    @precondition(lambda self: self.m.placed is not None and len(self.m.placed["served"]) < len(self.windows))
    @rule(data=st.data())
    def serve(self, data):
        """A later layer reuses the placement."""
        placed = self.m.placed
        layer = data.draw(
            st.sampled_from([x for x in range(len(self.windows)) if x not in placed["served"]]), label="layer"
        )
        step = self.t.place_step(layer, [p for _, p in placed["tokens"]])
        self.check_step(step, layer)

    # -- calls that must be refused ------------------------------------------

    @rule(data=st.data())
    def refuse_a_bad_id(self, data):
        max_seqs = self.m.max_seqs
        out_of_range = st.sampled_from([-1, -(2**40), max_seqs, max_seqs + 7, 2**62])
        dead = [s for s in range(max_seqs) if s not in self.m.live]
        verb = data.draw(st.sampled_from(["seq_clone", "seq_rm", "declare_step", "seq_len", "next_pos"]), label="verb")
        if verb in ("seq_len", "next_pos") or not dead:  # an id not live answers 0 there
            bad = data.draw(out_of_range, label="bad id")
        else:
            bad = data.draw(out_of_range | st.sampled_from(dead), label="bad id")
        # mid-forward, a verb is refused for the forward before its arguments are looked at
        refused_for_the_forward = self.half_served() and verb not in ("seq_len", "next_pos")
        error, at = (StepError, "during a forward") if refused_for_the_forward else (SequenceError, None)
        if verb == "declare_step":
            ids = data.draw(st.lists(st.sampled_from(self.live()), max_size=3), label="live ids") if self.m.live else []
            ids.insert(data.draw(st.integers(0, len(ids)), label="at"), bad)
            self.refused(error, lambda: self.t.declare_step(ids), match=at or r"seq_ids\[")
        else:
            self.refused(error, lambda: getattr(self.bc, verb)(bad), match=at or f"={bad}")

    @precondition(lambda self: self.m.declared is not None)
    @rule(data=st.data())
    def refuse_a_miscounted_step(self, data):
        n = len(self.m.declared)
        count = data.draw(st.integers(0, n + 3).filter(lambda c: c != n), label="count")
        layer = data.draw(st.integers(0, len(self.windows) - 1), label="layer")
        positions = self.positions_for(data, (self.m.declared * 4)[:count])
        self.refused(StepError, lambda: self.t.place_step(layer, positions), match=r"position\(s\)")

    @precondition(lambda self: self.m.declared is not None)
    @rule(data=st.data())
    def refuse_a_position_not_newer(self, data):
        ids = self.m.declared
        if len(set(ids)) == len(ids) and not any(self.m.next_pos(s) for s in ids):
            return  # every position is newer than nothing: no token can go back
        positions = self.positions_for(data, ids)
        # token i may go back to anything its sequence already holds (before it or earlier in the step)
        held = [
            max([self.m.next_pos(s) - 1] + [positions[j] for j in range(i) if ids[j] == s]) for i, s in enumerate(ids)
        ]
        i = data.draw(st.sampled_from([i for i, h in enumerate(held) if h >= 0]), label="token")
        positions[i] = data.draw(st.integers(max(0, held[i] - 3), held[i]), label="old position")
        layer = data.draw(st.integers(0, len(self.windows) - 1), label="layer")
        self.refused(StepError, lambda: self.t.place_step(layer, positions), match="expected a position newer")

    @precondition(lambda self: self.m.declared is not None)
    @rule(data=st.data())
    def refuse_a_negative_position(self, data):
        positions = self.positions_for(data, self.m.declared)
        positions[data.draw(st.integers(0, len(positions) - 1), label="token")] = -1
        self.refused(StepError, lambda: self.t.place_step(0, positions), match=">= 0")

    @precondition(lambda self: self.m.placed is not None)
    @rule(data=st.data())
    def refuse_a_layer_served_twice(self, data):
        layer = data.draw(st.sampled_from(sorted(self.m.placed["served"])), label="layer")
        positions = [p for _, p in self.m.placed["tokens"]]
        self.refused(StepError, lambda: self.t.place_step(layer, positions), match="already served")

    @precondition(lambda self: self.m.declared is None and self.m.placed is None)
    @rule(data=st.data())
    def refuse_an_undeclared_step(self, data):
        layer = data.draw(st.integers(0, len(self.windows) - 1), label="layer")
        self.refused(StepError, lambda: self.t.place_step(layer, [10**6]), match="no step declared")

    BEFORE_PLACING = {
        "bad id": refuse_a_bad_id,
        "miscounted": refuse_a_miscounted_step,
        "not newer": refuse_a_position_not_newer,
        "negative": refuse_a_negative_position,
    }

    # -- after every rule ----------------------------------------------------

    @invariant()
    def the_table_agrees_with_the_model(self):
        t, m = self.t, self.m
        free = m.free()
        assert t.table.free_cells == len(free)
        assert t.table.free_list().tolist() == free
        assert t.table.used_end == m.used_end()
        assert t.table.can_extend(len(free)) and not t.table.can_extend(len(free) + 1)
        newest_cells = t.table.newest_cells(np.arange(m.max_seqs)).tolist()
        for s in range(m.max_seqs):
            assert (t.table.seq_len(s), t.table.next_pos(s)) == (m.seq_len(s), m.next_pos(s)), f"seq {s}"
            assert newest_cells[s] == m.newest_cell(s), f"seq {s}"  # where the placement continues it
        # Each sequence's cells by position (the per-sequence index grouped attention plans from).
        ids = np.arange(m.max_seqs)
        cells, positions, starts = t.table.seq_keys(ids)
        for s in range(m.max_seqs):
            got = list(zip(cells[starts[s] : starts[s + 1]].tolist(), positions[starts[s] : starts[s + 1]].tolist()))
            assert got == sorted(m.owned(s), key=lambda cp: cp[1]), f"seq {s}"


TestCellTable = CellTableMachine.TestCase
