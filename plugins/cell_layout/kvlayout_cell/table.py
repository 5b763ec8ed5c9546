"""The cell table: which token each cell holds and which sequences own it.

The neutral layer of the cell layout (integers and numpy only, no tensor type),
in the manner of llama.cpp's kv-cells: a few parallel per-cell arrays plus
per-sequence summaries kept in step by every verb.

Invariants every verb keeps:

- a cell is free iff `pos[c] == -1` iff it has no owner bit set;
- every occupied cell is in `[0, used_end)`, and `used_end` is 0 or one past
  the last occupied cell;
- `count[s]` is the number of cells s owns, `newest[s]` the largest
  position among them and `newest_cell[s]` the cell holding it (-1 when it
  owns none);
- an id is live from `seq_new`/`seq_clone` until a `seq_rm` leaves it owning
  no cell; an id that is not live owns nothing.

Every refusal is decided before anything is mutated, so a refused call leaves
the table exactly as it was. Lack of cells or ids is an answer (False/None),
never an exception.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvlayout.checks import FEW_ON_STEP, int_scalar
from kvlayout.config import check_up_front
from kvlayout.errors import ConfigError, SequenceError, StepError
from kvlayout_cell.seq_index import SeqIndex

_ONE = np.uint64(1)
_BIT = tuple(_ONE << np.uint64(b) for b in range(64))  # each bit of an owner word, made once


def _owns(owners: np.ndarray, s: int) -> np.ndarray:
    """bool [S]: which cells of owner words `owners` [S, words] have sequence s's bit set."""
    return (owners[:, s >> 6] >> np.uint64(s & 63)) & _ONE != 0


class CellTable:
    def __init__(self, capacity: int, max_seqs: int):
        self._capacity = int_scalar("capacity", capacity, ConfigError, minimum=1)
        self._max_seqs = int_scalar("max_seqs", max_seqs, ConfigError, minimum=1)
        check_up_front(
            f"a cell table of capacity={self._capacity} and max_seqs={self._max_seqs}",
            self.footprint(self._capacity, self._max_seqs),
            "lower capacity or max_seqs",
        )
        self._words = (self._max_seqs + 63) // 64  # owner bitset width: any max_seqs works
        self._epoch = 0
        self.clear()

    @staticmethod
    def footprint(capacity: int, max_seqs: int) -> dict[str, int]:
        """Bytes a table of this size holds from its first step on, by what holds them (before any
        is allocated: the constructor refuses a table larger than the machine's memory).

        Per cell: its position (int64), its owner words (one uint64 per 64 ids) and a free-list
        entry (int64, built at the first placement). Per id: a count, a newest position and the
        cell holding it (int64 each) and a live flag (bool).
        """
        per_cell = 16 + 8 * ((max_seqs + 63) // 64)
        return {
            f"cell table ({per_cell} B a cell: position, owner words, free list)": capacity * per_cell,
            "per-id arrays (25 B an id)": max_seqs * 25,
        }

    # -- state ---------------------------------------------------------------

    def clear(self) -> None:
        """Free every cell and release every id."""
        self._pos = np.full(self._capacity, -1, dtype=np.int64)  # [capacity], -1 = free
        self._owners = np.zeros((self._capacity, self._words), dtype=np.uint64)  # [capacity, words] bitset
        self._count = np.zeros(self._max_seqs, dtype=np.int64)  # cells owned, per id
        self._newest = np.full(self._max_seqs, -1, dtype=np.int64)  # newest position held, per id
        self._newest_cell = np.full(self._max_seqs, -1, dtype=np.int64)  # the cell holding it, per id
        self._live = np.zeros(self._max_seqs, dtype=bool)
        self._used_end = 0
        self._n_free = self._capacity
        self._free: np.ndarray | None = None  # ascending free cells, rebuilt lazily after a seq_rm
        self._index = SeqIndex(self._max_seqs)  # each id's cells by position (kvlayout_cell.seq_index)
        self._touch()

    def _touch(self) -> None:
        self._epoch += 1

    @property
    def epoch(self) -> int:
        """Changes whenever the table does; whatever holds a view of it (a placed step) compares."""
        return self._epoch

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def max_seqs(self) -> int:
        return self._max_seqs

    @property
    def free_cells(self) -> int:
        return self._n_free

    @property
    def used_end(self) -> int:
        return self._used_end

    def can_extend(self, n: int = 1) -> bool:
        return self._n_free >= int_scalar("n", n, StepError, minimum=0)

    # -- ids -----------------------------------------------------------------

    def _check_id(self, name: str, seq_id: Any) -> int:
        s = int_scalar(name, seq_id, SequenceError)
        if not 0 <= s < self._max_seqs:
            raise SequenceError(f"{name}={s}: expected an id in [0, {self._max_seqs})")
        return s

    def _check_live(self, name: str, seq_id: Any) -> int:
        s = self._check_id(name, seq_id)
        if not self._live[s]:
            raise SequenceError(f"{name}={s}: expected a live sequence, got an id not in use")
        return s

    def live_id(self, name: str, seq_id: Any) -> int:
        """`seq_id` as an int when it is a live id; SequenceError naming `name` otherwise."""
        return self._check_live(name, seq_id)

    def live_mask(self, ids: np.ndarray) -> np.ndarray:
        """bool, like `ids` (in range): which are live."""
        return self._live[ids]

    def newest_positions(self, ids: np.ndarray) -> np.ndarray:
        """The newest position each of `ids` (in range) holds, -1 for none."""
        return self._newest[ids]

    def _lowest_free_id(self) -> int | None:
        ids = np.flatnonzero(~self._live)
        return int(ids[0]) if ids.size else None

    def next_id(self) -> int | None:
        """The id `seq_new` would make live now; None when all are in use."""
        return self._lowest_free_id()

    def held(self, ids: np.ndarray) -> np.ndarray:
        """Cells each of `ids` (checked by the caller) owns: `seq_len` for many ids at once."""
        return self._count[ids]

    def seq_len(self, seq_id: int) -> int:
        """Cells `seq_id` owns (0 for an id not live)."""
        return int(self._count[self._check_id("seq_id", seq_id)])

    def next_pos(self, seq_id: int) -> int:
        """One past the newest position `seq_id` holds (0 when it holds none)."""
        return int(self._newest[self._check_id("seq_id", seq_id)]) + 1

    def newest_below(self, seq_id: int, position: int) -> int:
        """The newest position live `seq_id` (checked by the caller) holds below `position`, -1 for none:
        where it continues once everything from `position` on is gone (a hole below is not there to
        continue from)."""
        _, pos = self._index.get(int(seq_id))
        at = int(np.searchsorted(pos, position, side="left"))
        return int(pos[at - 1]) if at else -1

    def newest_cells(self, ids: np.ndarray) -> np.ndarray:
        """The cell holding each of `ids`' (checked by the caller) newest position, -1 for an id
        holding none: where a placement policy continues a sequence (a copy)."""
        return self._newest_cell[ids]

    def newest_cells_few(self, ids: list[int]) -> list[int]:
        """`newest_cells` of a decode step's few `ids` (checked by the caller), as Python ints."""
        newest_cell = self._newest_cell
        return [int(newest_cell[s]) for s in ids]

    def seq_new(self) -> int | None:
        """The lowest id not live, now live and empty; None when all are in use."""
        s = self._lowest_free_id()
        if s is None:
            return None
        self._live[s] = True
        self._touch()
        return s

    def seq_clone(self, src: int, upto: int | None = None, since: int = 0) -> int | None:
        """A new id sharing src's cells with since <= position < upto (upto None: to the end); no
        cell is copied. `since` > 0: what a window's layers keep of a clone (its last window).

        Refused (SequenceError) when src is not live; None when no id is left.
        """
        src = self._check_live("src", src)
        if upto is not None:
            upto = int_scalar("upto", upto, SequenceError, minimum=0)
        dst = self._lowest_free_id()
        if dst is None:
            return None
        self._index.copy_between(src, dst, since, upto)
        cells, pos = self._index.get(dst)  # src's cells with position < upto, by position
        self._owners[cells, dst >> 6] |= _ONE << np.uint64(dst & 63)
        self._count[dst] = cells.size
        self._newest[dst], self._newest_cell[dst] = (int(pos[-1]), int(cells[-1])) if cells.size else (-1, -1)
        self._live[dst] = True
        self._touch()
        return dst

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int | None = None, keep_live: bool = False) -> None:
        """Drop seq_id's claim on positions [p0, p1) (p1 None: to the end).

        A cell with no owner left is freed and `used_end` shrinks past freed
        tail cells; an id left owning nothing is released, unless `keep_live`
        (a window's table, whose sequence lives on in the other layers).
        Refused (SequenceError) for an id not live or a malformed range.
        """
        s = self._check_live("seq_id", seq_id)
        p0 = int_scalar("p0", p0, SequenceError, minimum=0)
        if p1 is not None:
            p1 = int_scalar("p1", p1, SequenceError, minimum=p0)
        cells = self._index.cut(s, p0, p1)  # the cells of its positions in [p0, p1)
        if cells.size:
            self._drop_claims(s, cells)
            newest = self._newest[s]
            if newest >= p0 and (p1 is None or newest < p1):  # the newest position went
                kept, at = self._index.get(s)
                self._newest[s], self._newest_cell[s] = (int(at[-1]), int(kept[-1])) if kept.size else (-1, -1)
        if self._count[s] == 0 and not keep_live:
            self._live[s] = False
            self._newest[s] = self._newest_cell[s] = -1
        self._touch()

    def retire(self, ids: np.ndarray, cuts: np.ndarray, apply: bool = True) -> int:
        """Drop each of `ids`' (live, distinct) claims on its positions below `cuts[i]` (at most its
        newest: ids stay live, newest and all): what a window's layers no longer read. Cells no owner
        claims any more are freed. Answers how many cells that frees; `apply` False: how many it
        would free, nothing changed (the admission gate asks before it retires anything)."""
        if not ids.size:
            return 0
        if apply:
            parts = [self._index.cut(s, 0, cut) for s, cut in zip(ids.tolist(), cuts.tolist())]
            freed = self._drop_many(np.repeat(ids, [c.size for c in parts]), np.concatenate(parts))
            self._touch()
            return freed
        parts = []  # per id, the cells of its positions below its cut
        for s, cut in zip(ids.tolist(), cuts.tolist()):
            cells, pos = self._index.get(s)
            parts.append(cells[: int(np.searchsorted(pos, cut, side="left"))])
        cells = np.concatenate(parts)
        owner = np.repeat(ids, [c.size for c in parts])  # [n]: whose claim each entry is
        uniq, at = np.unique(cells, return_inverse=True)
        gone = np.zeros((uniq.size, self._words), dtype=np.uint64)  # [u, words]: the owner bits going
        np.bitwise_or.at(gone, (at.reshape(-1), owner >> 6), _ONE << (owner & 63).astype(np.uint64))
        return int((~(self._owners[uniq] & ~gone).any(axis=1)).sum())

    def _drop_many(self, owner: np.ndarray, cells: np.ndarray) -> int:
        """`_drop_claims` of many owners at once: owner[i]'s claim on cells[i] (each pair once, just
        cut from the index). One numpy pass, however many sequences retire in a step."""
        if not cells.size:
            return 0
        # bitwise_and.at: two owners of one cell in one owner word are two updates of the same element.
        np.bitwise_and.at(self._owners, (cells, owner >> 6), ~(_ONE << (owner & 63).astype(np.uint64)))
        self._count -= np.bincount(owner, minlength=self._max_seqs)
        touched = np.unique(cells)
        freed = touched[~self._owners[touched].any(axis=1)]
        self._free_cells(freed)
        return int(freed.size)

    def _free_cells(self, freed: np.ndarray) -> None:
        """`freed` (ascending, now owned by nobody) become free; `used_end` shrinks past free tail cells."""
        self._pos[freed] = -1
        self._n_free += freed.size
        if freed.size:
            if self._free is not None:  # merged in (a memmove), not rebuilt by a pass over every cell
                free = np.insert(self._free, np.searchsorted(self._free, freed), freed)
                free.flags.writeable = False
                self._free = free
            end = self._used_end
            if freed[-1] == end - 1:  # the tail cell went: shrink past every free tail cell
                occupied = np.flatnonzero(self._pos[:end] >= 0)
                self._used_end = int(occupied[-1]) + 1 if occupied.size else 0

    def _drop_claims(self, s: int, cells: np.ndarray) -> int:
        """Clear s's owner bit on `cells` (its, just cut from the index); free those left with no
        owner, shrinking `used_end` past freed tail cells. How many it freed."""
        if not cells.size:
            return 0
        cells = np.sort(cells)
        self._owners[cells, s >> 6] &= ~(_ONE << np.uint64(s & 63))
        freed = cells[~self._owners[cells].any(axis=1)]
        self._count[s] -= cells.size
        self._free_cells(freed)
        return int(freed.size)

    # -- placement primitives (the step protocol lives in stepper.py) --------

    def free_list(self) -> np.ndarray:
        """The free cells, ascending (int64, read-only).

        Kept between placements: a placement removes its cells, only a seq_rm
        that frees cells forces a rebuild (one numpy pass over [0, used_end)).
        """
        if self._free is None:
            end = self._used_end
            free = np.concatenate(
                [np.flatnonzero(self._pos[:end] < 0), np.arange(end, self._capacity)]
            ).astype(np.int64)
            free.flags.writeable = False
            self._free = free
        return self._free

    def check_live_ids(self, seq_ids: np.ndarray, listed: list[int] | None = None) -> None:
        """Refuse (SequenceError) an id out of range or not live, naming the first one. `listed`: the
        same ids as Python ints, when the caller has them (a decode step's few)."""
        if listed is not None or seq_ids.size <= FEW_ON_STEP:  # a decode step's: Python settles them faster
            live, top = self._live, self._max_seqs
            if all(0 <= s < top and live[s] for s in (seq_ids.tolist() if listed is None else listed)):
                return
        if seq_ids.size and (seq_ids.min() < 0 or seq_ids.max() >= self._max_seqs):
            out = np.flatnonzero((seq_ids < 0) | (seq_ids >= self._max_seqs))
            self._check_id(f"seq_ids[{out[0]}]", int(seq_ids[out[0]]))
        if not self._live[seq_ids].all():
            dead = np.flatnonzero(~self._live[seq_ids])
            self._check_live(f"seq_ids[{dead[0]}]", int(seq_ids[dead[0]]))

    def newer_few(self, seq_ids: list[int], positions: Sequence[int]) -> bool:
        """Whether each of a decode step's few tokens (live ids, as Python ints, each its sequence's only
        one) is newer than its id's newest position: `check_tokens` would pass them. False says nothing
        more: `check_tokens` then says what is wrong."""
        newest = self._newest
        return len(seq_ids) == len(positions) and all(p > newest[s] for s, p in zip(seq_ids, positions))

    def check_tokens(self, seq_ids: np.ndarray, positions: np.ndarray, declared: bool = False,
                     distinct: bool = False) -> None:
        """Refuse (StepError) unless each token's position is newer than its sequence holds.

        "Holds" includes the step's own earlier tokens, so a sequence's
        positions must also rise within the step. Ids must be live. `declared`: `seq_ids` were
        checked live by a declaration at this epoch (nothing changed since: not checked again);
        `distinct`: no id is twice among them (each token is its sequence's only one).
        """
        if seq_ids.shape != positions.shape:
            raise StepError(f"{positions.size} position(s) for {seq_ids.size} declared token(s)")
        if not declared:
            self.check_live_ids(seq_ids)
        if (distinct or positions.size == 1) and (
            all(p > n for p, n in zip(positions.tolist(), self._newest[seq_ids].tolist()))
            if positions.size <= FEW_ON_STEP
            else (positions > self._newest[seq_ids]).all()
        ):
            return  # one token a sequence (decode steps), each newer than its id's newest (>= -1): so >= 0 too
        if positions.size and positions.min() < 0:
            i = int(np.flatnonzero(positions < 0)[0])
            raise StepError(f"positions[{i}]={positions[i]}: expected a position >= 0")
        order = np.lexsort((np.arange(seq_ids.size), seq_ids))  # by sequence, then token order
        s, p = seq_ids[order], positions[order]
        first = np.ones(s.size, dtype=bool)
        first[1:] = s[1:] != s[:-1]
        prev = np.where(first, self._newest[s], np.roll(p, 1))
        bad = np.flatnonzero(p <= prev)
        if bad.size:
            k = bad[0]
            i, held = int(order[k]), int(prev[k])
            raise StepError(
                f"positions[{i}]={p[k]} for sequence {s[k]}: expected a position newer than "
                f"{held}, which it already holds (next_pos {held + 1})"
            )

    def occupy(self, cells: np.ndarray, seq_ids: np.ndarray, positions: np.ndarray, distinct: bool = False) -> None:
        """Put token i (position positions[i], owner seq_ids[i]) in cells[i].

        The caller has run `check_tokens`, and `cells` (int64, one per token) are distinct cells of
        `free_list()`: the placement hook's answer, checked by the plugin manager's referee
        (`kvlayout.registry`), not again here. `distinct`: no id is twice among `seq_ids` (a decode
        step), so each id's count and newest move by its one token, with no sorting.
        """
        if cells.size == 0:
            return
        if (distinct or cells.size == 1) and cells.size <= FEW_ON_STEP:
            self.occupy_few(cells.tolist(), seq_ids.tolist(), positions.tolist())
            return
        self._pos[cells] = positions
        self._index.append(seq_ids, positions, cells)
        # Each cell is distinct and had no owner, so plain fancy assignment sets one bit per cell.
        self._owners[cells, seq_ids >> 6] = _ONE << (seq_ids & 63).astype(np.uint64)
        if distinct:  # each token newer than its id held (check_tokens): it is the id's newest now
            self._count[seq_ids] += 1
            self._newest[seq_ids], self._newest_cell[seq_ids] = positions, cells
        else:
            self._count += np.bincount(seq_ids, minlength=self._max_seqs)
            self._raise_newest(cells, seq_ids, positions)
        self._used_end = max(self._used_end, int(cells.max()) + 1)
        self._n_free -= cells.size
        if self._free is not None:  # cells are a subset of the ascending free list
            if np.array_equal(cells, self._free[: cells.size]):
                # The lowest free cells, in order (the default placement): drop the head, a view.
                # np.delete would copy the whole list, O(capacity) per step (~4 ms at 1M cells).
                self._free = self._free[cells.size :]
            else:
                free = np.delete(self._free, np.searchsorted(self._free, cells))
                free.flags.writeable = False
                self._free = free
        self._touch()

    def occupy_few(self, cells: list[int], seq_ids: list[int], positions: Sequence[int]) -> tuple:
        """`occupy` of a decode step's few tokens, as Python ints (distinct ids, each newer than its id
        holds, as `newer_few` or `check_tokens` found; distinct free cells), in scalar steps; what
        `before_occupy` would have answered just before it, for `release`.

        On a step's path every numpy call is cold (the model's work in between evicts it) and costs
        microseconds to tens of them: the array path's dozen cost ~0.3 ms a step at 8 sequences.
        The free list loses a head of the lowest free cells as a view (a lowest-free placement's); any
        other cells drop it rather than edit it (np.delete copies it whole, O(capacity), every step):
        `free_list` rebuilds it when a placement asks, which a decode step placed by the default
        placement's first pass never does (`Stepper._choose`)."""
        newest, newest_cell, pos, owners, count, index = (
            self._newest, self._newest_cell, self._pos, self._owners, self._count, self._index)
        held, held_cell = [], []  # each id's newest and its cell before: ids distinct, restored one by one
        for cell, s, position in zip(cells, seq_ids, positions):
            held.append(newest[s])  # numpy scalars, written back as they are
            held_cell.append(newest_cell[s])
            pos[cell] = position
            index.append_one(s, position, cell)
            owners[cell, s >> 6] = _BIT[s & 63]  # the cell was free: no other owner bit to keep
            count[s] += 1
            newest[s] = position  # newer than it held (the caller's check): its newest now
            newest_cell[s] = cell
        before = (seq_ids, held, held_cell, self._used_end, self._free)
        self._used_end = max(self._used_end, max(cells) + 1)
        self._n_free -= len(cells)
        free = self._free
        # Whether they are its head, asked cell by cell: a decode step's few (one, alone), each a scalar read.
        if free is not None and free.size >= len(cells) and all(free[i] == c for i, c in enumerate(cells)):
            self._free = free[len(cells) :]  # the lowest free cells, in order (a lowest-free placement): a view
        else:
            self._free = None
        self._touch()
        return before

    def is_free(self, cell: int) -> bool:
        """Whether `cell` (an int) is one of `free_list()`'s, asked without building the list."""
        return 0 <= cell < self._capacity and (cell >= self._used_end or self._pos[cell] < 0)

    def _raise_newest(self, cells: np.ndarray, seq_ids: np.ndarray, positions: np.ndarray) -> None:
        """Keep `newest`/`newest_cell` of the ids just given `cells`: each id's newest among its
        new tokens, where newer than what it held (check_tokens makes it so for a step)."""
        order = np.lexsort((positions, seq_ids))  # by id, then position
        ids = seq_ids[order]
        last = np.flatnonzero(np.r_[ids[1:] != ids[:-1], True])  # each id's newest new token
        ids, pos, at = ids[last], positions[order][last], cells[order][last]
        newer = pos > self._newest[ids]
        self._newest[ids[newer]] = pos[newer]
        self._newest_cell[ids[newer]] = at[newer]

    def visible(
        self,
        seq_ids: np.ndarray,
        positions: np.ndarray,
        window: int = 0,
        placed: np.ndarray | None = None,
        state: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> np.ndarray:
        """bool [T, used_end]: token i sees cell j iff j is occupied, owned by seq_ids[i],
        pos_j <= positions[i], and (window > 0) pos_j >= positions[i] - window + 1.

        Vectorized over tokens x cells. Only the owner words the step's
        sequences live in are read, transposed to one contiguous byte row per
        (word, byte) so each token gathers its row with a memcpy: no
        [T, used_end] uint64 temporary and no strided gather.

        `placed`: the cells these very tokens were just placed in (by
        `occupy`, nothing since). Every other cell a token's sequence owns is
        then older than the token (check_tokens saw to it), so a flat layer
        needs the position test only on those T columns.

        `state`: `(positions, owner words)` of cells `[0, S)` copied from
        the table earlier (see `snapshot`), to read instead of the table now.
        """
        pos, owners = self.snapshot(copy=False) if state is None else state  # [S], [S, words]
        mask = self._owned_rows(seq_ids, owners)  # [T, S]
        p = positions[:, None]  # [T, 1]
        if window or placed is None:
            mask &= pos[None, :] <= p
        else:
            mask[:, placed] &= pos[placed][None, :] <= p  # [T, T]: causal within the step
        if window:
            mask &= pos[None, :] >= p - (window - 1)
        return mask

    def snapshot(self, copy: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(positions [used_end], owner words [used_end, words]) of the cells up to used_end."""
        end = self._used_end
        pos, owners = self._pos[:end], self._owners[:end]
        return (pos.copy(), owners.copy()) if copy else (pos, owners)

    def _owned_rows(self, seq_ids: np.ndarray, owners: np.ndarray | None = None) -> np.ndarray:
        """bool [len(seq_ids), S]: row i says which cells seq_ids[i] owns (see `visible`), in `owners`
        (owner words [S, words]; default: the table's, S = used_end)."""
        owners = self._owners[: self._used_end] if owners is None else owners
        if seq_ids.size == 1:  # one token (a lone decode): test its bit directly, no byte transpose
            return _owns(owners, int(seq_ids[0]))[None, :]  # [1, S]
        words, word_of = np.unique(seq_ids >> 6, return_inverse=True)
        packed = np.ascontiguousarray(owners[:, words]).astype("<u8", copy=False)  # [S, W']
        by_byte = np.ascontiguousarray(packed.view(np.uint8).T)  # [8 W', S]: bit b of word w in row 8w + b // 8
        bit = seq_ids & 63
        rows = by_byte[word_of.reshape(-1) * 8 + (bit >> 3)]  # [N, S]
        return (rows & (np.uint8(1) << (bit & 7).astype(np.uint8))[:, None]) != 0  # free cells own nothing

    def seq_keys(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(cells, positions, starts): the cells each of `ids` (ascending, distinct) owns, ids[i]'s at
        `[starts[i], starts[i + 1])`, by position (copies). O(the cells they own), from the
        per-sequence index: what grouped attention plans from (kvlayout_cell.groups.plan_cells)."""
        parts = [self._index.get(int(s)) for s in ids]
        sizes = np.array([c.size for c, _ in parts], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)])  # [N + 1]
        if len(parts) == 1:
            return parts[0][0].copy(), parts[0][1].copy(), starts
        return (np.concatenate([c for c, _ in parts]) if parts else np.zeros(0, dtype=np.int64),
                np.concatenate([p for _, p in parts]) if parts else np.zeros(0, dtype=np.int64), starts)

    # -- undoing a placement (abort_step, in stepper.py, decides when) -------

    def before_occupy(self, seq_ids: np.ndarray, ids: np.ndarray | None = None) -> tuple:
        """What `occupy(cells, seq_ids, ...)` will change beyond the cells themselves (`ids`: the
        distinct ones among `seq_ids`, when the caller has them).

        Taken just before `occupy`, it lets `release` put every summary back.
        The free list is held by reference: `occupy` replaces it, never edits it.
        """
        ids = np.unique(seq_ids) if ids is None else ids
        return ids, self._newest[ids], self._newest_cell[ids], self._used_end, self._free  # (indexing copies)

    def release(self, cells: np.ndarray, seq_ids: np.ndarray, before: tuple) -> None:
        """Undo `occupy(cells, seq_ids, ...)`, given `before_occupy(seq_ids)` from just before it.

        Valid only while nothing else changed the table in between (the caller
        compares epochs). The cells were free, so they go back to free with no
        owner; each owner's count and newest position, `used_end`, the free
        count and the free list return to what they were. Liveness is
        untouched: occupy never changes it. The epoch moves on.
        """
        ids, newest, newest_cell, used_end, free = before
        self._index.truncate(seq_ids)
        self._pos[cells] = -1
        self._owners[cells] = 0
        self._count -= np.bincount(seq_ids, minlength=self._max_seqs)
        self._newest[ids] = newest
        self._newest_cell[ids] = newest_cell
        self._used_end = used_end
        self._n_free += cells.size
        self._free = free
        self._touch()

    # -- saving and restoring (the file format lives in persist.py) ----------

    @property
    def owner_words(self) -> int:
        """uint64 words per cell in the owner bitset."""
        return self._words

    def cell_owners(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(cells, positions, owners bool [n, max_seqs]) of every occupied cell (the CellView face)."""
        cells, pos, words = self.occupied()
        bits = np.unpackbits(words.astype("<u8").view(np.uint8), axis=1, bitorder="little")  # [n, 64 * words]
        return cells, pos, bits[:, : self._max_seqs].astype(bool)

    def live_ids(self) -> np.ndarray:
        """The live ids, ascending."""
        return np.flatnonzero(self._live)

    def occupied(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(cells, positions, owner words) of every occupied cell, ascending; copies.

        Together with `live_ids` this is the whole table: counts, newest
        positions, `used_end` and the free list follow from it.
        """
        cells = np.flatnonzero(self._pos[: self._used_end] >= 0)
        return cells, self._pos[cells].copy(), self._owners[cells].copy()

    def seq_cells(self, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(cells, positions) seq_id owns, by position; SequenceError for an id not live."""
        s = self._check_live("seq_id", seq_id)
        cells, pos, _ = self.seq_keys(np.array([s]))
        return cells, pos

    def restore(self, cells: np.ndarray, pos: np.ndarray, owners: np.ndarray, live: np.ndarray, error: type) -> None:
        """Become the table `occupied()` and `live_ids()` described; `error` (nothing changed) if they
        break an invariant: a cell out of range or repeated, a negative position, a cell with no owner
        or an owner out of range or not live, a sequence holding one position twice."""
        n = cells.shape[0] if cells.ndim == 1 else -1
        if n < 0 or pos.shape != (n,) or owners.shape != (n, self._words):
            raise error(
                f"cells {cells.shape}, positions {pos.shape}, owners {owners.shape}: "
                f"expected [n], [n], [n, {self._words}]"
            )
        if n and (cells.min() < 0 or cells.max() >= self._capacity or np.unique(cells).size != n):
            raise error(f"cells: expected distinct cells in [0, {self._capacity})")
        if n and pos.min() < 0:
            raise error("positions: expected positions >= 0")
        if live.ndim != 1 or (live.size and (live.min() < 0 or live.max() >= self._max_seqs)):
            raise error(f"live ids: expected ids in [0, {self._max_seqs})")
        is_live = np.zeros(self._max_seqs, dtype=bool)
        is_live[live] = True
        count = np.zeros(self._max_seqs, dtype=np.int64)
        newest = np.full(self._max_seqs, -1, dtype=np.int64)
        newest_cell = np.full(self._max_seqs, -1, dtype=np.int64)
        any_owner = np.zeros(n, dtype=bool)
        held_by = []  # (id, positions, cells) for the index
        for s in range(self._words * 64):  # every bit of the owner words, in range or not
            owned = _owns(owners, s)
            if not owned.any():
                continue
            if s >= self._max_seqs or not is_live[s]:
                raise error(
                    f"owners: sequence {s} owns cells but is {'out of range' if s >= self._max_seqs else 'not live'}"
                )
            held = pos[owned]
            if np.unique(held).size != held.size:
                raise error(f"sequence {s} holds one position in two cells")
            at = int(np.argmax(held))
            count[s], newest[s], newest_cell[s] = held.size, held[at], cells[owned][at]
            held_by.append((s, held, cells[owned]))
            any_owner |= owned
        if not any_owner.all():
            raise error("owners: every occupied cell needs an owner")
        self.clear()
        self._pos[cells] = pos
        self._owners[cells] = owners
        self._count, self._newest, self._newest_cell, self._live = count, newest, newest_cell, is_live
        for s, held, at in held_by:
            self._index.set_all(s, held, at)
        self._used_end = int(cells.max()) + 1 if n else 0
        self._n_free = self._capacity - n
        self._free = None
        self._touch()
