"""The per-sequence index (kvlayout_cell.seq_index) against the owner bits, after random verb sequences
that include multi-sequence steps undone by release (abort_step), restore and clear."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvlayout.errors import StateError
from kvlayout_cell.table import CellTable


def from_bits(t: CellTable, s: int) -> list[tuple[int, int]]:
    """(cell, position) of s's cells by position, from occupied() and the owner words alone."""
    cells, pos, owners = t.occupied()
    mine = (owners[:, s >> 6] >> np.uint64(s & 63)) & np.uint64(1)
    out = [(int(c), int(p)) for c, p, m in zip(cells, pos, mine) if m]
    return sorted(out, key=lambda cp: cp[1])


def check(t: CellTable, max_seqs: int) -> None:
    ids = np.arange(max_seqs)
    cells, positions, starts = t.seq_keys(ids)
    for s in range(max_seqs):
        got = list(zip(cells[starts[s] : starts[s + 1]].tolist(), positions[starts[s] : starts[s + 1]].tolist()))
        want = from_bits(t, s)
        assert got == want, f"seq {s}"
        assert t.seq_len(s) == len(want)
        assert t.next_pos(s) == (max((p for _, p in want), default=-1) + 1)


@pytest.mark.parametrize("seed", range(6))  # the table model check (test_stateful) covers the rest
def test_seq_index_agrees_with_the_owner_bits(seed):
    rng = random.Random(seed)
    capacity, max_seqs = rng.choice([(24, 3), (40, 5), (64, 66)])
    t = CellTable(capacity, max_seqs)
    for _ in range(300):
        live = t.live_ids().tolist()
        verb = rng.choice(["new", "clone", "rm", "step", "step", "abort", "restore", "clear"] if live else ["new"])
        if verb == "new":
            t.seq_new()
        elif verb == "clone":
            src = rng.choice(live)
            upto = rng.choice([None, rng.randint(0, t.next_pos(src) + 1)])
            t.seq_clone(src, upto)
        elif verb == "rm":
            s = rng.choice(live)
            p0 = rng.randint(0, t.next_pos(s) + 1)
            p1 = rng.choice([None, rng.randint(p0, t.next_pos(s) + 2)])
            t.seq_rm(s, p0, p1)
        elif verb in ("step", "abort"):
            free = t.free_list().tolist()
            n = min(len(free), rng.randint(1, 6))
            if n == 0:
                continue
            ids = [rng.choice(live) for _ in range(n)]
            nxt = {s: t.next_pos(s) for s in set(ids)}
            pos = []
            for s in ids:
                pos.append(nxt[s] + rng.choice([0, 0, 1]))
                nxt[s] = pos[-1] + 1
            cells = np.array(rng.sample(free, n), dtype=np.int64)
            seq_ids, positions = np.array(ids, dtype=np.int64), np.array(pos, dtype=np.int64)
            t.check_tokens(seq_ids, positions)
            before = t.before_occupy(seq_ids)
            t.occupy(cells, seq_ids, positions)
            if verb == "abort":
                check(t, max_seqs)
                t.release(cells, seq_ids, before)
        elif verb == "restore":
            cells, pos, owners = t.occupied()
            live_ids = t.live_ids()
            other = CellTable(capacity, max_seqs)
            other.restore(cells, pos, owners, live_ids, StateError)
            check(other, max_seqs)
            t.restore(cells, pos, owners, live_ids, StateError)
        else:
            t.clear()
        check(t, max_seqs)
