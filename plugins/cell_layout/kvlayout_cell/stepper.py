"""The step protocol of the cell layout: declare, place once, reuse per layer.

Still neutral (numpy and the plugin manager, no tensor type). A Stepper
holds a CellTable and is the only thing that changes it: every verb that
touches the cells goes through here, so the stepper always knows when the
open step ends. One forward is one step:

1. `declare_step(seq_ids)` names the sequence of each token (the admission
   gate: False when the free cells are too few);
2. the first layer served calls `place_step(layer, positions)`: the cells come
   from the `kvlayout_choose_cells` hook (told each token's sequence, position
   and the cell its sequence's newest position is in) and are claimed all
   together;
3. every later layer reuses that placement; the CellStep (cells + mask) is
   built once per distinct window and announced through
   `kvlayout_step_placed`, then shared by every layer with that window.

A step stays valid while the table's epoch is the one placement left: any verb
(seq_new, seq_clone, seq_rm, clear, restore, place_sequence) ends it, and so
does a new declaration. While it is half served (placed, some layers not yet
served: a forward in progress), those verbs and `declare_step` are refused
(StepError, nothing changed), so no state ever holds K/V that some layers
never wrote; `clear` alone goes ahead, aborting the step first.

The BatchControl face (`kvlayout.faces`) takes this class's verbs that change
the table (`declare_step`, `seq_new`, `seq_clone`, `seq_rm`, `clear`) and the
table's own counts (`free_cells`, `seq_len`, ...), each implemented once
(`batch_control`); the rest (`abort_step`, `place_sequence`,
`restore`, `unserved_layers`, `step_tokens`) serve the cache and its persist
module. A `kvlayout_choose_cells` answer is trusted: the plugin manager's
referee checked it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from kvlayout.checks import FEW_ON_STEP, frozen_ints, int_array, int_scalar
from kvlayout.errors import ConfigError, SequenceError, StepError
from kvlayout.faces import CellStep
from kvlayout.positions import StepPositions, frozen, step_positions
from kvlayout.registry import observed, sole_implementation
from kvlayout_cell.placement import choose_cells, continue_each, distinct_sorted, page_for
from kvlayout_cell.placement import kvlayout_choose_cells as registered_default
from kvlayout_cell.table import CellTable
from kvlayout_cell.window import WindowKeeper

NOTHING_DUE = (frozen(np.zeros(0, dtype=np.int64)), frozen(np.zeros(0, dtype=np.int64)))  # (ids, cuts): none
HOOKS = ("kvlayout_choose_cells", "kvlayout_step_placed", "kvlayout_step_aborted")  # what the stepper calls


@attrs.define(eq=False)
class _Placed:
    """A placed step: its tokens, their cells and which layers have been served."""

    seq_ids: np.ndarray
    positions: np.ndarray  # [T], read-only
    cells: np.ndarray
    read_len: int
    epoch: int
    served: set[int]
    steps: dict[int, CellStep]  # window -> memoized step
    before: tuple = ()  # the table's summaries from before the placement, for abort_step
    built: set[int] = attrs.Factory(set)  # windows whose (lazy) mask has been built
    frozen: tuple | None = None  # the table's cells as the step saw them, kept once it moves on
    source: StepPositions | None = None  # the positions that placed it: later layers given it are the same
    declared_ids: list[int] | None = None  # seq_ids as Python ints, when the declaration had them (`_Declared.listed`)

    @classmethod
    def claim(cls, table: CellTable, declared: _Declared, pos: StepPositions, cells: np.ndarray,
              served: set[int]) -> _Placed:
        """Occupy `cells` (checked free) of `table` with the declared tokens at `pos`: the step placed,
        which abort_step can undo."""
        seq_ids = declared.seq_ids
        before = table.before_occupy(seq_ids, declared.unique)
        table.occupy(cells, seq_ids, pos.host, distinct=declared.distinct)  # the only mutation
        return cls(seq_ids, pos.host, cells, table.used_end, table.epoch, served, {}, before, source=pos)

    @classmethod
    def claim_few(cls, table: CellTable, declared: _Declared, pos: StepPositions, cells: list[int],
                  served: set[int]) -> _Placed:
        """`claim` of a decode step's few tokens (`declared.listed`, each newer than its id holds) in the
        free `cells`, as Python ints: the table settles them in scalar steps (`CellTable.occupy_few`).
        The cells are kept as the read-only int32 array a CellStep hands out, made once."""
        before = table.occupy_few(cells, declared.listed, pos.listed)  # the only mutation
        held = np.array(cells, dtype=np.int32)
        held.flags.writeable = False
        return cls(declared.seq_ids, pos.host, held, table.used_end, table.epoch, served, {}, before, source=pos,
                   declared_ids=declared.listed)


@attrs.define(eq=False)
class _Declared:
    """A declaration standing at `epoch`: its ids checked live then, frozen; `unique`: the distinct ones;
    `listed`: the ids as Python ints when they are a decode step's (few, each once), else None."""

    seq_ids: np.ndarray
    epoch: int
    unique: np.ndarray
    listed: list[int] | None = None

    @classmethod
    def of(cls, seq_ids: np.ndarray, epoch: int, ours: bool = False, listed: list[int] | None = None) -> _Declared:
        # Frozen copies: the caller keeps its own. `ours`: frozen by the stepper already (`declarable`),
        # `listed`: the same ids as Python ints, the stepper's own copy.
        ids = seq_ids if ours else frozen(np.asarray(seq_ids, dtype=np.int64))
        if listed is not None and len(set(listed)) == len(listed):
            return cls(ids, epoch, ids, listed)  # distinct as they are: no sort needed
        if ids.size < 2:
            return cls(ids, epoch, ids)
        return cls(ids, epoch, distinct_sorted(ids))

    @property
    def distinct(self) -> bool:
        """Whether each token is its sequence's only one (a decode step)."""
        return self.unique.size == self.seq_ids.size


class Stepper:
    """Places steps for `len(windows)` layers (window 0 = flat) over `table`, which it alone changes.

    `keeper`: the table is one sliding window's (`kvlayout_cell.window`): each declaration first
    retires what the sequences that moved on no longer read, and a clone or rewind that would need
    retired keys is refused."""

    def __init__(self, table: CellTable, windows: Sequence[int], pm: Any, keeper: WindowKeeper | None = None):
        self.table = table  # read it freely; change it only through the stepper's verbs
        self.keeper = keeper
        self._windows = tuple(int_scalar("window", w, ConfigError, minimum=0) for w in windows)
        hook = getattr(pm, "hook", None)  # checked now: a bad one would fail at the first step
        missing = [name for name in HOOKS if not hasattr(hook, name)]
        if missing:
            raise ConfigError(
                f"pm={pm!r:.80}: expected a kvlayout plugin manager (kvlayout.registry.plugin_manager() or "
                f"make_plugin_manager()), got one without the hook(s) {', '.join(missing)}"
            )
        self._pm = pm
        self._declared: _Declared | None = None
        self._placed: _Placed | None = None
        # The last ids `declarable` froze from a decode step's list, with that list copied: (frozen, listed).
        self._few: tuple[np.ndarray, list[int]] | None = None

    @property
    def n_layers(self) -> int:
        return len(self._windows)

    def window(self, layer: int) -> int:
        """Layer `layer`'s window (0 = flat); StepError for a layer out of range."""
        return self._windows[checked_layer(self.n_layers, layer)]

    def served_step(self, layer: int) -> CellStep | None:
        """The open step's CellStep for `layer` (shared by its window), once `layer` has served it;
        else None. StepError for a layer out of range."""
        layer = checked_layer(self.n_layers, layer)
        placed = self._open_step()
        if placed is None or layer not in placed.served:
            return None
        return placed.steps.get(self._windows[layer])

    # -- verbs that change the table: each ends the open step first ------------

    def clear(self) -> None:
        """Free every cell and release every id. A half-served step (a forward in progress) is
        aborted first (`abort_step`: its observers hear `kvlayout_step_aborted`): clear is how a
        runtime holding only the BatchControl face starts over."""
        if self.unserved_layers():
            self.abort_step()
        self._keep_masks()
        self.table.clear()
        if self.keeper is not None:
            self.keeper.clear()

    def seq_new(self) -> int | None:
        """The lowest id not live, now live and empty; None when all are in use."""
        self._refuse_mid_forward("seq_new")
        return self.table.seq_new()  # changes no cell: no mask to keep

    def seq_clone(self, src: int, upto: int | None = None, end: int | None = None) -> int | None:
        """A new id sharing src's cells with position < upto (all when None); no cell is copied.

        Refused (SequenceError) when src is not live; None when no id is left. `end`: src's next
        position in every layer (a window's table may hold none of its newest; default: this table's).
        """
        since = self.check_clone(src, upto, end)
        self._keep_masks()
        dst = self.table.seq_clone(src, upto, since)
        if dst is not None and self.keeper is not None:
            # Below since it holds nothing here, whatever elsewhere; a clone of nothing (src holds no position
            # below upto, so it continues at 0: `end` 0) is cut nowhere.
            self.keeper.cut[dst] = 0 if upto == 0 or end == 0 else since
            if src in self.keeper.pinned:
                self.keeper.moved.add(dst)  # it holds src's whole history: retired unless pinned in turn
        return dst

    def check_clone(self, src: int, upto: int | None, end: int | None = None) -> int:
        """Refuse (nothing changed) what `seq_clone(src, upto, end)` would refuse; else where the clone
        starts in this table (0 but for a window's: its last window)."""
        self._refuse_mid_forward("seq_clone")
        s = self.table.live_id("src", src)
        newest = (self.table.next_pos(s) if end is None else end) - 1
        if upto is not None:
            upto = int_scalar("upto", upto, SequenceError, minimum=0)
        if self.keeper is None:
            return 0
        at = newest + 1 if upto is None or upto > newest else upto  # where the clone is continued
        self.keeper.check_continue(f"seq_clone(src={s}, upto={upto})", s, at)
        return self.keeper.clone_since(s, upto, newest)

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int | None = None, keep_live: bool = False,
               end: int | None = None, at: int | None = None) -> None:
        """Drop seq_id's claim on positions [p0, p1) (see `CellTable.seq_rm`; `keep_live`: the id stays
        live owning nothing, as a window's table keeps a sequence its other layers hold; `end` as for
        `seq_clone`, `at` as for `check_rm`)."""
        self.check_rm(seq_id, p0, p1, end, at)
        self._keep_masks()
        self.table.seq_rm(seq_id, p0, p1, keep_live)
        if self.keeper is not None and not self.table.seq_len(seq_id) and not keep_live:
            self.keeper.released(int(seq_id))

    def check_rm(self, seq_id: int, p0: int, p1: int | None, end: int | None = None, at: int | None = None) -> None:
        """Refuse (nothing changed) what `seq_rm(seq_id, p0, p1)` would refuse: a range cutting a
        sequence's end off (at or past `end`, its next position) where the window it would continue
        from was retired. `at`: where it continues then (one past its newest position below p0, as a
        flat group knows it; default p0)."""
        self._refuse_mid_forward("seq_rm")
        s = self.table.live_id("seq_id", seq_id)
        p0 = int_scalar("p0", p0, SequenceError, minimum=0)
        if p1 is not None:
            p1 = int_scalar("p1", p1, SequenceError, minimum=p0)
        end = self.table.next_pos(s) if end is None else end
        if self.keeper is not None and (p1 is None or p1 >= end):  # its end goes: it is continued at p0
            self.keeper.check_continue(f"seq_rm(seq_id={s}, p0={p0})", s, p0 if at is None else at)

    def restore(self, cells: np.ndarray, pos: np.ndarray, owners: np.ndarray, live: np.ndarray, error: type,
                cuts: np.ndarray | None = None) -> None:
        """Become the table `occupied()` and `live_ids()` described (see `CellTable.restore`), a
        window's with its `cuts` per id (None: nothing retired); `error`, nothing changed, for a
        description that breaks an invariant."""
        self._refuse_mid_forward("restore")
        if cuts is not None and (cuts.shape != (self.table.max_seqs,) or (cuts < 0).any()):
            raise error(f"cuts {cuts.shape}: expected [{self.table.max_seqs}] positions >= 0")
        self._keep_masks()
        self.table.restore(cells, pos, owners, live, error)
        if self.keeper is not None:
            self.keeper.clear()
            if cuts is not None:
                self.keeper.cut[:] = cuts
            self.keeper.moved.update(self.table.live_ids().tolist())

    # -- the step protocol ---------------------------------------------------

    def declare_step(self, seq_ids: Sequence[int]) -> bool:
        """Name the sequence of each token of the next forward.

        False (nothing changed, any previous step still standing) when fewer
        than len(seq_ids) cells are free. Raises for an empty list
        (StepError) or an id out of range or not live (SequenceError), and
        (StepError) while the previous step is half served: finish that
        forward or abort it first. On True the previous step ends.
        """
        ids = self.declarable(seq_ids)
        due = self.room_for(ids)
        if due is None:
            return False
        self.commit_declare(ids, due)
        return True

    def declarable(self, seq_ids: Sequence[int]) -> np.ndarray:
        """`seq_ids` as declare_step checks them (refusing as it does), as an array of the stepper's own,
        frozen (`kvlayout.positions.frozen`): the caller keeps theirs, and nobody can change these."""
        self._refuse_mid_forward("declare_step")
        ids = frozen_ints(seq_ids)  # a decode step's few ids: frozen in one numpy call
        listed = None
        if ids is None:
            ids = frozen(int_array("seq_ids", seq_ids, SequenceError))
        else:
            listed = list(seq_ids)  # ints, as frozen_ints found them: kept for the step's checks in Python
        if ids.size == 0:
            raise StepError("declare_step: seq_ids is empty: expected at least one token's sequence id")
        self.table.check_live_ids(ids, listed)
        self._few = None if listed is None else (ids, listed)
        return ids

    def room_for(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """What declaring `ids` (checked by `declarable`) would retire first, `(ids, cuts)`, when the
        cells are then there; None when they are not. Nothing changed: `commit_declare` applies it.
        The retire is counted (a dry run) only when the free cells alone are too few."""
        due, free = self._due(), self.table.free_cells
        fits = ids.size <= free or ids.size <= free + self.table.retire(*due, apply=False)
        return due if fits else None

    def commit_declare(self, ids: np.ndarray, due: tuple[np.ndarray, np.ndarray]) -> None:
        """Declare `ids` (as `declarable` answered them: frozen, the stepper's own), `room_for(ids)` having
        answered `due` with nothing changed since: retire it, then the previous step ends and this
        declaration stands."""
        self._keep_masks()
        if due[0].size:  # what moved past its window goes before the new tokens come
            self.table.retire(*due)
            self.keeper.cut[due[0]] = due[1]
        if self.keeper is not None:
            self.keeper.moved.clear()
        few = self._few
        listed = few[1] if few is not None and few[0] is ids else None  # declarable's list of these very ids
        self._declared = _Declared.of(ids, self.table.epoch, ours=True, listed=listed)
        self._placed = None

    def _due(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, cuts) a window's table retires at the next declaration (none for a flat one)."""
        if self.keeper is None or not self.keeper.moved:
            return NOTHING_DUE
        ids = np.array(sorted(self.keeper.moved), dtype=np.int64)
        ids = ids[self.table.live_mask(ids)]
        return self.keeper.due(self.table.newest_positions(ids), ids)

    def place_step(self, layer: int, positions: Sequence[int]) -> CellStep:
        """The step for `layer`: placed by the first layer served, reused by the others.

        StepError (nothing changed; a standing declaration stays for a
        corrected retry) for a layer out of range or already served, a step
        with no declaration, a token count differing from it, a position not
        newer than its sequence holds, a bad `kvlayout_choose_cells` answer, or
        a `kvlayout_step_placed` observer that raises (the observers that heard
        of the refused window hear it taken back through `kvlayout_step_aborted`).
        """
        layer = checked_layer(self.n_layers, layer)
        pos = step_positions(positions)
        placed = self._open_step()
        if placed is not None:
            if layer in placed.served:
                raise StepError(
                    f"layer {layer} was already served in this step: expected each layer once "
                    "per step; declare_step the next forward first"
                )
            # The forward's one StepPositions is the placing one, frozen: only another object is compared.
            if pos is not placed.source and not np.array_equal(pos.host, placed.positions):
                raise StepError(
                    f"layer {layer}: positions {pos.host.tolist()!r:.80} differ from the step's "
                    f"{placed.positions.tolist()!r:.80}, placed by an earlier layer"
                )
            placed.served.add(layer)
            try:
                return self._step(placed, self._windows[layer])
            except BaseException:
                placed.served.discard(layer)  # an observer refused it: the layer is not served
                raise
        declared = self._declared if self._declared is not None and self._declared.epoch == self.table.epoch else None
        if declared is None:
            why = " (a verb since the last declaration ended that step)" if self._declared or self._placed else ""
            raise StepError(f"layer {layer}: no step declared{why}; expected declare_step(seq_ids) first")
        if pos.size != declared.seq_ids.size:
            raise StepError(
                f"layer {layer}: {pos.size} position(s) for a step declared with "
                f"{declared.seq_ids.size} token(s)"
            )
        placed = self._placed = self._claim_few(declared, pos, layer) or self._claim(declared, pos, layer)
        if self.keeper is not None:
            self.keeper.moved.update(declared.unique.tolist() if declared.listed is None else declared.listed)
        try:
            step = self._step(placed, self._windows[layer])
        except BaseException:  # an observer refused the placement: undone, the declaration stands
            with contextlib.suppress(Exception):
                self.abort_step()
            self._declared = attrs.evolve(declared, epoch=self.table.epoch)
            raise
        self._declared = None
        return step

    def _claim(self, declared: _Declared, pos: StepPositions, layer: int) -> _Placed:
        """Place and claim the declared step at `pos`, refusing (nothing changed) what `place_step` refuses."""
        # Refuses before anything changes; the ids were checked live by the declaration, at this epoch.
        self.table.check_tokens(declared.seq_ids, pos.host, declared=True, distinct=declared.distinct)
        cells = self._choose(declared.seq_ids, pos.host)
        return _Placed.claim(self.table, declared, pos, cells, {layer})

    def _claim_few(self, declared: _Declared, pos: StepPositions, layer: int) -> _Placed | None:
        """`_claim` of a decode step's few tokens settled in Python: each newer than its sequence holds
        and placed by the default placement's first pass (`_continued`); None, nothing changed, for any
        other step (`_claim` then places it, or says what is wrong)."""
        listed = declared.listed
        if listed is None or pos.size > FEW_ON_STEP or not self.table.newer_few(listed, pos.listed):
            return None
        cells = self._continued(listed)
        return None if cells is None else _Placed.claim_few(self.table, declared, pos, cells, {layer})

    def _continued(self, seq_ids: list[int]) -> list[int] | None:
        """The default placement's answer for a decode step of `seq_ids` (distinct live ids, as ints) when
        its first pass places it whole and it is the only placement registered; else None."""
        if sole_implementation(self._pm, "kvlayout_choose_cells") is not registered_default:
            return None
        page = page_for(0 if self.keeper is None else self.keeper.window)
        with contextlib.suppress(Exception):  # pure: `_choose` asks again, and its hook names the plugin
            return continue_each(self.table.newest_cells_few(seq_ids), self.table.is_free, page)
        return None

    def serve_again(self, layer: Any, positions: Any) -> CellStep | None:
        """`place_step` for a later layer of the open step handed the very StepPositions object its
        placement was made with (frozen: it cannot have changed), when `layer` is a plain int in range
        that has not served the step and its window's CellStep is built: the layer served, that step.
        Else None, nothing changed: `place_step` decides, and says what is wrong."""
        placed = self._placed
        if (placed is None or positions is not placed.source or type(layer) is not int
                or not 0 <= layer < len(self._windows) or layer in placed.served or placed.epoch != self.table.epoch):
            return None
        step = placed.steps.get(self._windows[layer])
        if step is not None:  # not built yet: place_step builds it (and announces it to any observer)
            placed.served.add(layer)
        return step

    def abort_step(self) -> bool:
        """Undo the open step, as if it had never been placed; False when none is open.

        The open step is the one the first `place_step` after a declaration
        placed, served on every layer or not, until a new declaration or any
        verb (`seq_new`, `seq_clone`, `seq_rm`, `clear`, `restore`,
        `place_sequence`) ends it; while some layer has not served it, those
        are refused (`clear` aborts it first). Aborting it releases exactly the cells it
        claimed and puts back every sequence's `seq_len` and `next_pos`, the
        free count, `used_end` and the free list. Afterwards no declaration
        stands: declare the next forward again. With no open step nothing
        changes (a standing declaration that was never placed stays) and the
        answer is False.

        The pools are not rolled back: the layers that ran before a failure
        wrote K/V into the released cells, which are free again, so their
        content is dead, overwritten before any mask lets it be read.
        Every window announced through `kvlayout_step_placed` is then
        announced through `kvlayout_step_aborted`; an observer that raises is
        raised once every window was announced, the step aborted all the same.
        """
        placed = self._open_step()
        if placed is None:
            return False
        # Its observers hear of it below, after the release: one may read (or keep) a mask not built yet.
        self._keep_masks(heard=observed(self._pm, "kvlayout_step_aborted"))
        self._placed = self._declared = None
        self.table.release(placed.cells, placed.seq_ids, placed.before)
        failed = []
        for window, step in placed.steps.items():  # those announced by kvlayout_step_placed
            try:
                self._pm.hook.kvlayout_step_aborted(step=step, window=window)
            except Exception as exc:  # the step is aborted all the same; every window is announced
                failed.append(exc)
        if failed:
            raise failed[0]
        return True

    def place_sequence(self, positions: Sequence[int], cut: int = 0,
                       close: bool = True) -> tuple[int, np.ndarray] | None:
        """A new sequence holding `positions` (ascending, distinct, >= 0): `(seq_id, cells)`.

        What restoring a saved sequence takes: its tokens are placed as one
        step would place them (cells from `kvlayout_choose_cells`, each window
        announced through `kvlayout_step_placed`), and the step is closed at
        once, so there is nothing to abort and no layer to serve. None,
        nothing changed, when the free cells or ids are too few; StepError,
        nothing changed, for bad positions, a bad hook answer, an observer that
        raises or a step half served. The caller writes the K/V into `cells`
        (token i's into cells[i]). `cut`: in a window's table, where the sequence was cut (it holds
        nothing of its positions below). `close` False: the step stays open, every layer served, so
        `abort_step` (then `seq_rm` of the id) can still take it back; `close_step` ends it.
        """
        self._refuse_mid_forward("place_sequence")
        steps = step_positions(positions)
        pos = steps.host
        if pos.size and (pos.min() < 0 or (np.diff(pos) <= 0).any()):
            raise StepError(f"positions {pos.tolist()!r:.80}: expected ascending distinct positions >= 0")
        next_id = self.table.next_id()
        if pos.size > self.table.free_cells or next_id is None:
            return None
        # The id it is about to get, holding nothing yet.
        declared = _Declared.of(np.full(pos.size, next_id, dtype=np.int64), self.table.epoch)
        seq_ids = declared.seq_ids
        cells = self._choose(seq_ids, pos) if pos.size else np.zeros(0, dtype=np.int64)  # may refuse: before any change
        self._keep_masks()
        seq_id = self.table.seq_new()
        if pos.size:
            placed = self._placed = _Placed.claim(self.table, declared, steps, cells, set(range(self.n_layers)))
            try:
                for window in sorted(set(self._windows)):
                    self._step(placed, window)
            except BaseException:  # an observer refused it: no cell, no id left behind
                with contextlib.suppress(Exception):
                    self.abort_step()
                self.table.seq_rm(seq_id)
                raise
        if self.keeper is not None:
            self.keeper.cut[seq_id] = cut
            self.keeper.moved.add(seq_id)
        if close:
            self.close_step()
        return seq_id, cells

    def close_step(self) -> None:
        """End the open step now, as any verb would (none open: nothing changes but a standing
        declaration, dropped)."""
        self._keep_masks()  # a late reader of an announced mask gets it as placed
        self._placed = self._declared = None

    @property
    def placing(self) -> bool:
        """Whether a step is open (placed, no verb or declaration since: see `abort_step`)."""
        return self._open_step() is not None

    def unserved_layers(self) -> list[int]:
        """The layers the open step has not served yet (none open: [])."""
        placed = self._open_step()
        if placed is None or len(placed.served) == len(self._windows):  # served holds layers in range only
            return []
        return sorted(set(range(self.n_layers)) - placed.served)

    def step_token_lists(self) -> tuple[list[int], tuple[int, ...]]:
        """`step_tokens` as Python ints (the declaration's and the positions' own, when a decode step's few
        gave them: no copy); StepError when no step is open."""
        seq_ids, positions = self.step_tokens()
        declared = self._placed.declared_ids  # the open step's (step_tokens checked one is open)
        return (seq_ids.tolist() if declared is None else declared), self._placed.source.listed

    def step_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """(seq_ids, positions) of the open step's tokens; StepError when none is open."""
        placed = self._open_step()
        if placed is None:
            raise StepError("no step is open: expected declare_step and place_step first")
        return placed.seq_ids, placed.positions

    # -- inside ----------------------------------------------------------------

    def _refuse_mid_forward(self, verb: str) -> None:
        """StepError, nothing changed, while the open step is half served: the verb would end it
        with K/V some layers never wrote in its cells, read as zeros by every later step."""
        missing = self.unserved_layers()
        if missing:
            raise StepError(
                f"{verb} during a forward: layer(s) {missing} of the placed step were not served; "
                "finish the forward, or abort_step() (or clear()) first"
            )

    def _open_step(self) -> _Placed | None:
        """The open step (see `abort_step`): placed, and no verb or declaration since; else None."""
        placed = self._placed
        return placed if placed is not None and placed.epoch == self.table.epoch else None

    def _keep_masks(self, heard: bool = False) -> None:
        """The open step ends: if a mask of it was never built and someone may still read it, keep
        what building it reads.

        A copy of positions and owner words up to the step's read_len (O(used_end) memcpy, far
        less than a [T, used_end] mask), so a consumer that reads `step.mask` late still gets the
        step's mask, not one of the table as it is by then. Only a holder of the CellStep can read
        it (an observer that kept it, a lazy spec, a caller of place_step): when nobody but this
        stepper holds one (a decode step's, usually), nothing is copied. `heard`: observers are about to
        be handed the steps (an abort's): kept whatever the count says.
        """
        placed = self._open_step()
        if placed is None or placed.frozen is not None:
            return
        unbuilt = [w for w in placed.steps if w not in placed.built]
        if unbuilt and (heard or any(_refs(placed.steps, w) > HELD_HERE_ONLY for w in unbuilt)):
            placed.frozen = self.table.snapshot()

    def _choose(self, seq_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """A distinct free cell for each token, from the hook; StepError when no plugin answers.

        The hook hears each token's sequence, position and the cell its sequence's newest position
        is in (-1: none; ids not yet live hold none), frozen arrays a policy cannot disturb
        (`kvlayout.positions.frozen`: not even by making them writable).
        The answer is trusted: the plugin manager's referee (`kvlayout.registry`) refused any
        answer that is not `count` distinct cells of `free`, naming the plugin. When the layout's own
        default (`placement.kvlayout_choose_cells`) is the only placement registered, its rule is called as it is:
        pluggy and the referee cost ~20 us a step, and the default is held to the referee's rule by
        its tests. Should it raise, the hook's call says so, naming the plugin."""
        count = positions.size
        window = 0 if self.keeper is None else self.keeper.window
        if sole_implementation(self._pm, "kvlayout_choose_cells") is registered_default:
            with contextlib.suppress(Exception):  # pure: the hook's call below fails alike, and names the plugin
                prev = self.table.newest_cells(seq_ids)
                if count <= FEW_ON_STEP:  # a decode step's first pass, asked of the table cell by cell
                    cells = continue_each(prev.tolist(), self.table.is_free, page_for(window))
                    if cells is not None:
                        return np.array(cells, dtype=np.int64)
                # Its own function writes none of its arguments and answers a new int64 array: no copies.
                return choose_cells(self.table.free_list(), seq_ids, prev, window)
        answer = self._pm.hook.kvlayout_choose_cells(
            free=self.table.free_list(),
            count=count,
            seq_ids=seq_ids,  # frozen (a declaration's)
            positions=positions,  # frozen (StepPositions.host)
            prev_cells=frozen(self.table.newest_cells(seq_ids)),  # a new array; ids checked in range; not live: -1
            window=window,
        )
        if answer is None:
            raise StepError(
                f"kvlayout_choose_cells: no plugin answered; expected {count} distinct cells from the free list"
            )
        return np.array(answer, dtype=np.int64)  # a copy: the step keeps its own, whatever the policy keeps

    def _step(self, placed: _Placed, window: int) -> CellStep:
        step = placed.steps.get(window)
        if step is None:

            def mask() -> np.ndarray:  # [T, read_len], built on first access: grouped attention never reads it
                # Read after the step ended, it comes from the cells as the step saw them (`_keep_masks`).
                m = self.table.visible(placed.seq_ids, placed.positions, window, placed.cells, placed.frozen)
                m.flags.writeable = False  # shared by every layer with this window, and by observers
                placed.built.add(window)
                return m

            cells = placed.cells
            if cells.dtype != np.int32 or cells.flags.writeable:  # claim_few made them as a step hands them out
                cells = cells.astype(np.int32)
                cells.flags.writeable = False
            step = CellStep(length=placed.cells.size, read_len=placed.read_len, cells=cells, mask=mask)
            placed.steps[window] = step
            if not (observed(self._pm, "kvlayout_step_placed") or observed(self._pm, "kvlayout_step_aborted")):
                # Nobody to tell (a server's observer, a trace: only when registered); an abort's observers
                # hear of every window announced here, so with one of those it is announced all the same.
                return step
            try:
                self._pm.hook.kvlayout_step_placed(step=step, window=window)
            except BaseException:  # refused: the observers that heard of this window hear it taken back
                del placed.steps[window]
                placed.built.discard(window)
                with contextlib.suppress(Exception):
                    self._pm.hook.kvlayout_step_aborted(step=step, window=window)
                raise
        return step


def _refs(holder: dict, key: Any) -> int:
    """How many references `holder[key]` has, as `sys.getrefcount` counts them in this call. CPython
    counts every reference: a count above HELD_HERE_ONLY means someone beyond `holder` holds it."""
    return sys.getrefcount(holder[key])


HELD_HERE_ONLY = _refs({0: object()}, 0)  # a value its dict alone holds, counted the same way


def checked_layer(n_layers: int, layer: Any) -> int:
    """`layer` as an int in [0, n_layers); StepError otherwise."""
    if type(layer) is int and 0 <= layer < n_layers:
        return layer  # every layer of every step comes here: the usual one settled at once
    layer = int_scalar("layer", layer, StepError, minimum=0)
    if layer >= n_layers:
        raise StepError(f"layer={layer}: expected a layer in [0, {n_layers})")
    return layer
